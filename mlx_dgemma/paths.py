"""Paths as the user typed them: ``~`` and ``$VARS`` expanded, as a shell would.

A path reaches us unexpanded whenever no shell did the work: quoted on the command line
(``--model "~/models/dgemma"``), from an environment variable (``MLX_DGEMMA_MODEL``), or
from Python (``load("~/models/dgemma")``). Every entry point that accepts a path calls this.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def user_path(path: str | os.PathLike) -> Path:
    """``path`` with environment variables and a leading ``~`` expanded (nothing else changes)."""
    return Path(os.path.expanduser(os.path.expandvars(os.fspath(path))))


MODEL_ENV = "MLX_DGEMMA_MODEL"


def configured_model() -> str | None:
    """``$MLX_DGEMMA_MODEL`` (``~`` and variables expanded), or None when unset or blank."""
    value = os.environ.get(MODEL_ENV, "").strip()
    return str(user_path(value)) if value else None


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
    problem = input_problem(p)
    if problem is not None:
        origin = f" (from {MODEL_ENV})" if source == MODEL_ENV else ""
        raise ModelFilesError(f"{p}{origin}: {problem}; give a .gguf file or a directory written by "
                              "`mlx-dgemma convert`")
    return p


def check_gguf_input(path: str | os.PathLike, error: type[Exception] | None = None) -> Path:
    """A .gguf input (``convert``, ``verify``) that is a readable regular file, ``~`` expanded;
    else ``error`` (default ModelFilesError) with one line saying what the path is instead."""
    p = user_path(path)
    problem = input_problem(p, want_dir=False)
    if problem is not None:
        if error is None:
            from .errors import ModelFilesError as error
        raise error(f"{p}: {problem}; give the path of a DiffusionGemma .gguf file saved on disk")
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
