"""The command's standard streams: what it prints arrives, or it says in one line why not.

* Standard output closed (``>&-``): refused before any work. The next file the command opened
  would take its descriptor and receive what it prints.
* Standard output failing (a full disk, ``>/dev/full``): a one-line :class:`OutputError`, not a
  traceback; a reader that went away (``| head -1``) is left to ``cli.main``, quiet as ``cat``.
* Standard error closed or failing: its lines (progress, notices) are dropped, pointed at
  /dev/null, never at the cost of the command's own output: ``generate 2>/dev/full`` still
  prints its answer.

Standard library only: ``cli.main`` wraps every command in :func:`standard_streams`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from .errors import OutputError


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null and drop what its buffer holds there (the
    interpreter's last flush at exit then succeeds: a failed one turns the exit status into 120)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # an in-memory stream (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
    try:
        stream.flush()
    except (OSError, ValueError):
        pass


class _Stream:
    """A standard stream that handles its own write errors (every other attribute is the
    stream's: ``isatty``, ``fileno``, ``encoding``)."""

    def __init__(self, stream: TextIO, essential: bool):
        self._stream = stream
        # standard output: what the command is for (a failure ends it, said in one line);
        # standard error: progress and notices (a failure drops them)
        self._essential = essential

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        if self._essential and isinstance(e, BrokenPipeError):
            raise e  # the reader went away: cli.main stops quietly (exit 141)
        _to_devnull(self._stream)
        if self._essential:
            raise OutputError(f"standard output: cannot write ({e.strerror or e}); free some space or send it "
                              "elsewhere") from None


def stdout_closed() -> bool:
    """Standard output was closed when the process started (``>&-``: Python leaves it None)."""
    return sys.stdout is None


@contextmanager
def standard_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` for the length of a command, as the module says (a
    closed standard output is left as it is: check :func:`stdout_closed` before any work).
    Restored on the way out."""
    if sys.stderr is None:  # closed: what would go there goes nowhere, not into stdout
        null = os.open(os.devnull, os.O_WRONLY)
        if null != 2:
            os.dup2(null, 2)
            os.close(null)
        sys.stderr = open(2, "w", closefd=False)
    old = sys.stdout, sys.stderr
    if sys.stdout is not None:
        sys.stdout = _Stream(sys.stdout, essential=True)  # type: ignore[assignment]
    sys.stderr = _Stream(sys.stderr, essential=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
