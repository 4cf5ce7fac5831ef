"""Paths as the user typed them: ``~`` and ``$VARS`` expanded, as a shell would.

A path reaches us unexpanded whenever no shell did the work: quoted on the command line
(``--model "~/models/dgemma"``), from an environment variable (``MLX_DGEMMA_MODEL``), or
from Python (``load("~/models/dgemma")``). Every entry point that accepts a path calls this.

Also the checks of a path before any work: an input (:func:`input_problem`, the model's
:func:`resolve_model`) and an output file (:func:`check_output_file`, written with
:func:`open_output`): the one rule every command's output files follow.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def user_path(path: str | os.PathLike) -> Path:
    """``path`` with environment variables and a leading ``~`` expanded (nothing else changes)."""
    return Path(os.path.expanduser(os.path.expandvars(os.fspath(path))))


MODEL_ENV = "MLX_DGEMMA_MODEL"


def configured_model() -> str | None:
    """``$MLX_DGEMMA_MODEL`` (``~`` and variables expanded), or None when unset or blank."""
    value = os.environ.get(MODEL_ENV, "").strip()
    return str(user_path(value)) if value else None


EMPTY = "an empty path"


def empty_path(path: str | os.PathLike) -> bool:
    """``path`` is empty or blank: ``Path("")`` is ".", the current directory, never what an
    empty value meant (checked on the value given, before it becomes a Path)."""
    return not os.fspath(path).strip()


def input_problem(path: Path, want_dir: bool | None = None) -> str | None:
    """What is wrong with reading ``path`` as an input (None: nothing), from one ``stat``:
    missing, a symlink loop or permission problem, a FIFO, socket or device (which would
    block or never end), or a directory where a file is wanted (``want_dir=False``) or a
    file where a directory is (``want_dir=True``). Standard library only: a mistyped path is
    refused before any heavy import."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "no such file or directory"
    except OSError as e:  # symlink loops (ELOOP), permissions on a parent, names too long
        return f"cannot open it ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        if want_dir is False:
            return "is a directory, not a file"
        return None if os.access(path, os.R_OK | os.X_OK) else "not readable (permission denied)"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, socket or device)"
    if want_dir is True:
        return "is a file, not a directory"
    return None if os.access(path, os.R_OK) else "not readable (permission denied)"


def check_model_path(path: str | os.PathLike, source: str = "--model") -> Path:
    """A model path (a .gguf file or a converted directory) that can be read, ``~`` expanded;
    else ModelFilesError naming where the path came from (``source``: the flag, or
    ``MLX_DGEMMA_MODEL``)."""
    from .errors import ModelFilesError

    p = user_path(path)
    problem = EMPTY if empty_path(path) else input_problem(p)
    if problem is not None:
        origin = f" (from {MODEL_ENV})" if source == MODEL_ENV else ""
        raise ModelFilesError(f"{repr(os.fspath(path)) if problem == EMPTY else p}{origin}: {problem}; give a "
                              ".gguf file or a directory written by `mlx-dgemma convert`")
    return p


def check_gguf_input(path: str | os.PathLike, error: type[Exception] | None = None) -> Path:
    """A .gguf input (``convert``, ``verify``) that is a readable regular file, ``~`` expanded;
    else ``error`` (default ModelFilesError) with one line saying what the path is instead."""
    p = user_path(path)
    problem = EMPTY if empty_path(path) else input_problem(p, want_dir=False)
    if problem is not None:
        if error is None:
            from .errors import ModelFilesError as error
        raise error(f"{repr(os.fspath(path)) if problem == EMPTY else p}: {problem}; give the path of a "
                    "DiffusionGemma .gguf file saved on disk")
    return p


def check_model_choice(model: str | None, demo: bool, flag: str = "--model") -> None:
    """``--demo`` and ``--model`` (``flag``: how the command takes a model) name two different
    models: refuse rather than silently pick one."""
    from .errors import ParameterError

    if demo and model:
        raise ParameterError(f"--demo and {flag} {model}: give one of them (--demo runs the built-in "
                             f"demo model; {flag} runs yours)")


def resolve_model(model: str | None, demo: bool, required: bool = True, flag: str = "--model") -> str | None:
    """The model path a front end opens: ``--model`` (``flag``: how the command takes it, e.g.
    plan's positional ``MODEL``), else ``$MLX_DGEMMA_MODEL`` (None with ``--demo``), checked to
    be a readable file or directory before anything heavy is imported. With neither,
    ParameterError if ``required`` (the chat app instead offers the demo)."""
    from .errors import ParameterError

    check_model_choice(model, demo, flag)
    if demo:
        return None
    if model:
        return str(check_model_path(model, flag))
    env = configured_model()
    if env:
        return str(check_model_path(env, MODEL_ENV))
    if required:
        raise ParameterError(f"{flag}: not given; pass a converted directory or a .gguf file, or set "
                             f"{MODEL_ENV} to one (or --demo for the built-in demo model)")
    return None


# --------------------------------------------------------------------------- output files
#
# The one rule for every file a command writes (generate --trace, bench --json, the chat app's
# trace export; convert's output directory takes its input check from here too): an input of
# the same command is refused before any work, whatever the spelling (``./x``, a symlink, a
# hard link); an existing FIFO or character device (a pipe, /dev/null, a terminal) is written in
# place, never replaced by a regular file; a regular file is replaced atomically (written beside
# it under a temporary name, then renamed), and a symlink keeps pointing where it did.


def _within(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or lies inside it (both resolved)."""
    return path == root or root in path.parents


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _stat(path: str | os.PathLike) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):  # missing, a loop, a NUL byte: not the same file as anything
        return None


def output_clash(path: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> str | None:
    """How writing ``path`` would overwrite or mix with one of ``inputs`` (None: it would not):
    ``path`` is that input (the same resolved path, or the same file through a hard link), lies
    inside it (a converted model directory's files) or contains it (an output directory around
    the input).
    Also this process's standard output or error where they are regular files: replacing the
    file the shell opened for ``> FILE`` loses what the command prints there."""
    real = Path(os.path.realpath(path))
    st = _stat(path)
    for given in inputs:
        inp = user_path(given)
        inp_real = Path(os.path.realpath(inp))
        inp_st = _stat(inp)
        what = "directory" if inp_st is not None and stat.S_ISDIR(inp_st.st_mode) else "file"
        if real == inp_real or (st is not None and inp_st is not None and _same_file(st, inp_st)):
            return f"is the input {what} {inp}"
        if _within(real, inp_real):
            return f"is inside the input {what} {inp}"
        if _within(inp_real, real):
            return f"contains the input {what} {inp}"
    if st is not None and stat.S_ISREG(st.st_mode):
        for fd, name in ((1, "standard output"), (2, "standard error")):
            try:
                std = os.fstat(fd)
            except OSError:
                continue
            if stat.S_ISREG(std.st_mode) and _same_file(st, std):
                return f"is this command's {name} (the file it prints to)"
    return None


@dataclass(frozen=True)
class OutputFile:
    """An output file checked before any work (:func:`check_output_file`); open it with
    :func:`open_output`."""

    flag: str  # how the command names it, for errors: "--trace", "--json"
    given: str  # as typed
    target: Path  # where the bytes go: symlinks followed
    in_place: bool  # an existing FIFO or character device: written as it is, never replaced


def check_output_file(path: str | os.PathLike, flag: str, inputs: Iterable[str | os.PathLike | None] = (),
                      example: str = "out.json") -> OutputFile:
    """Where ``flag`` (an option naming an output file) may write, checked before any work;
    else ParameterError in one line. Refused: an empty path, a directory, a socket or block
    device, a missing or unwritable directory, a file that cannot be written, and any of
    ``inputs`` (the command's model, prompt file, ...; None entries are skipped: see
    :func:`output_clash`). ``example``: a file name the errors suggest."""
    from .errors import ParameterError

    given = os.fspath(path)
    shown = given if given.strip() else repr(given)

    def refuse(problem: str) -> ParameterError:
        return ParameterError(f"{flag} {shown}: {problem}")

    if empty_path(given):
        raise refuse(f"{EMPTY}; give a file name, e.g. {example}")
    p = user_path(given)
    try:
        st: os.stat_result | None = os.stat(p)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as e:  # a symlink loop, a parent that is a file, a NUL byte
        raise refuse(f"cannot use it ({getattr(e, 'strerror', None) or e}); give another file name") from None
    clash = output_clash(p, [i for i in inputs if i is not None])
    is_dir = st is not None and stat.S_ISDIR(st.st_mode)
    if clash is not None and not (is_dir and clash.startswith("contains")):  # "." around the model: a directory
        raise refuse(f"{clash}: a command never writes over or into what it reads; give another file name")
    if is_dir:
        raise refuse(f"is a directory; give a file name, e.g. {p / example}")
    if st is not None and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        if not os.access(p, os.W_OK):
            raise refuse("not writable; choose another place")
        return OutputFile(flag, given, p, in_place=True)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise refuse("is a socket or a block device, not a file; give a file name")
    target = Path(os.path.realpath(p))  # through a symlink (even a dangling one): the link stays
    parent = target.parent
    if not parent.is_dir():
        raise refuse(f"the directory {parent} does not exist; create it first (mkdir -p) or give another "
                     "file name")
    if not os.access(parent, os.W_OK | os.X_OK) or (st is not None and not os.access(p, os.W_OK)):
        raise refuse("not writable; give a file name in a directory you can write")
    return OutputFile(flag, given, target, in_place=False)


@contextmanager
def open_output(out: OutputFile, mode: str = "w") -> Iterator[IO[Any]]:
    """The file to write ``out``'s content to: the FIFO or device itself (in place), else a
    temporary file beside the target, renamed over it when the block ends without an error
    (removed otherwise: nothing half-written is left). A failure to write is ParameterError
    naming the flag."""
    from .errors import ParameterError

    tmp = None if out.in_place else out.target.with_name(f".{out.target.name[:200]}.partial-{os.getpid()}")
    try:
        with open(out.target if tmp is None else tmp, mode) as f:
            yield f
        if tmp is not None:
            os.replace(tmp, out.target)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            kept = "" if tmp is None else "; nothing was kept"
            raise ParameterError(f"{out.flag} {out.given}: cannot write ({e.strerror or e}){kept}") from e
        raise
