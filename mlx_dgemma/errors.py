"""Errors a user can act on: each prints as one line (file, tensor or parameter; what was
expected; what to do) and exits non-zero without a traceback unless --debug is given."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class DGemmaError(Exception):
    """Base class of every user-facing error."""

    exit_code = 2


class ModelFilesError(DGemmaError):
    """A model directory or file is missing something or is inconsistent."""


class ParameterError(DGemmaError, ValueError):
    """A parameter value is out of its allowed range. ``param`` (the field name) and ``rule``
    (what is allowed) let a front end restate the error with its own name, e.g. a CLI flag."""

    def __init__(self, message: str, param: str | None = None, rule: str | None = None):
        super().__init__(message)
        self.param, self.rule = param, rule


class OutputError(DGemmaError):
    """Standard output cannot take what the command prints: closed (``>&-``), or its disk is
    full (``>/dev/full``). Exit status 2, as for bad input: 1 means "nothing fits" to ``plan``
    and "a check failed" to ``verify`` and ``doctor``, which this is not."""


class PlatformError(DGemmaError):
    """This Python or this MLX cannot run the app here: an x86-64 Python on macOS (Rosetta or an
    Intel Mac), a macOS older than MLX's wheels, or an MLX without Metal."""


class NonFiniteError(DGemmaError):
    """NaN or Inf where numbers must be finite: a weight (named) or the logits of a step (named)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an interrupt, so the same clean-up runs as for Ctrl+C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _terminating() -> list[int]:
    return [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]


@contextmanager
def hold_interrupts() -> Iterator[None]:
    """Hold Ctrl+C (and SIGTERM/SIGHUP under :func:`terminate_as_interrupt`) until the block is
    done, then raise KeyboardInterrupt (:class:`Terminated` for those) (main thread only).

    For blocks that import third-party modules or build objects in native code, where an
    interrupt does not reliably arrive as KeyboardInterrupt: pydantic-core's Rust init turned
    it into ``PanicException`` (a traceback); an optional import wrapped in ``except ImportError``,
    mlx.core's native init and importlib's module-lock callback each swallowed it (the server
    then started anyway), and torch's native init (imported by mlx-lm through transformers)
    aborted the process. Keep such blocks short: nothing inside them can be interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # only the handlers that raise (not ours to change otherwise: a test runner, an embedding
    # app, a signal ignored, an outer hold)
    ours = {s: h for s, h in [(signal.SIGINT, signal.default_int_handler)] +
            [(s, _raise_terminated) for s in _terminating()] if signal.getsignal(s) is h}
    held: list[int] = []
    for s in ours:
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, h in ours.items():
            signal.signal(s, h)
    if held:
        raise KeyboardInterrupt if held[0] == signal.SIGINT else Terminated(held[0])


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (with ``signum``) like Ctrl+C, so the same
    clean-up runs; only in the main thread (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_terminated) for s in _terminating()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class MemoryBudgetError(DGemmaError, MemoryError):
    """A prompt's KV cache and working memory would not fit in the memory available."""
