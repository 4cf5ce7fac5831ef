"""Errors a user can act on: each prints as one line (file, tensor or parameter; what was
expected; what to do) and exits non-zero without a traceback unless --debug is given."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class DGemmaError(Exception):
    """Base class of every user-facing error."""

    exit_code = 2


class ModelFilesError(DGemmaError):
    """A model directory or file is missing something or is inconsistent."""


class ModelArgsError(ModelFilesError):
    """A field of the model's shape (``mlx_dgemma.schema.ModelArgs``) breaks its rule. ``field``
    (the ModelArgs field), ``name`` (the field, or the part of it at fault, in its source's words:
    a GGUF key, ``text_config.<field>``), ``rule`` (what is expected, from the field's ``ArgSpec``)
    and ``value`` (what it holds) let each front end say it with its file and what to do."""

    def __init__(self, field: str, name: str, rule: str, value: object = None):
        super().__init__(f"{name}: expected {rule}")
        self.field, self.name, self.rule, self.value = field, name, rule, value


class ParameterError(DGemmaError, ValueError):
    """A parameter value is out of its allowed range. ``param`` (the field name), ``rule`` (what
    is allowed: the registry's text, ``mlx_dgemma.params``) and ``note`` (why, where a rule
    between fields says more) let a front end restate the error with its own name for the
    field (:meth:`restated`): a CLI flag, a request field, a settings label."""

    def __init__(self, message: str, param: str | None = None, rule: str | None = None, note: str = ""):
        super().__init__(message)
        self.param, self.rule, self.note = param, rule, note

    def restated(self, name: str, value: str | None = None) -> str:
        """The error in a front end's words: ``NAME: must be RULE`` (``NAME: VALUE must be RULE``
        with ``value``), then the note; the message itself where there is no rule to restate."""
        if not self.rule:
            return str(self)
        said = f"{name}: {value} must be {self.rule}" if value is not None else f"{name}: must be {self.rule}"
        return f"{said}; {self.note}" if self.note else said


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


def _in_main_thread() -> bool:
    """Where Python runs signal handlers, and the only thread that may change them."""
    import threading  # not at the top: __main__ imports this module before the signals are held

    return threading.current_thread() is threading.main_thread()


def as_interrupt(signum: int) -> KeyboardInterrupt:
    """The exception a signal becomes: KeyboardInterrupt for Ctrl+C, :class:`Terminated` otherwise."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raising_signals() -> list[int]:
    """The signals whose handler raises an interrupt now: Ctrl+C's default handler, SIGTERM and
    SIGHUP under :func:`terminate_as_interrupt`; those a block may take over (and give back).
    Not a signal that is ignored, held, or handled by a caller of ours (a test runner, an app)."""
    return [s for s, h in [(signal.SIGINT, signal.default_int_handler)] +
            [(s, _raise_terminated) for s in _terminating()] if signal.getsignal(s) is h]


# The command's own hold, from its first statement to its last (hold_signals_at_start to
# end_signal_hold): the handlers it replaced, and the signals that arrived while they were noted
_start_held: dict[int, object] = {}
_arrived: list[int] = []


def _note_arrival(signum, frame) -> None:
    _arrived.append(signum)


def hold_signals_at_start() -> None:
    """The command's first statement (``mlx_dgemma.__main__``, before the rest of it is imported):
    Ctrl+C, SIGTERM and SIGHUP are noted, not acted on, until ``main()`` enters
    :func:`terminate_as_interrupt`, which raises the first of them there (the one line, the usual
    status), and again after that block (the command's last words) until :func:`end_signal_hold`.
    Without it a SIGTERM or SIGHUP in the imports before ``main()`` (~0.5 s on a loaded machine)
    killed the command without a word, and a Ctrl+C printed a traceback. A signal that is ignored
    (``nohup``; Ctrl+C in a shell's background job) or has a handler of the caller's is left
    alone. Main thread only."""
    for s, default in [(signal.SIGINT, signal.default_int_handler)] + [(s, signal.SIG_DFL) for s in _terminating()]:
        if signal.getsignal(s) == default:
            try:
                _start_held[s] = signal.signal(s, _note_arrival)
            except ValueError:  # not the main thread (asked there, not with _in_main_thread: its import costs time)
                return


def end_signal_hold(ignore: bool) -> None:
    """After the command's ``main()`` returned (its work done and kept, its status known), the
    signals :func:`hold_signals_at_start` holds are, with ``ignore``, ignored while the interpreter
    exits, so that the status is the command's: that exit tears torch and MLX down (plan,
    generate: 3 s on a loaded machine) and Python drops its handlers before it, so a signal there
    ended the process by that signal without a word. Without ``ignore`` they get their handlers
    from before back (under ``mlx.launch``, which ends ranks with SIGTERM alone). Main thread only."""
    if not _in_main_thread():
        return
    for s, h in _start_held.items():
        if signal.getsignal(s) is _note_arrival:
            signal.signal(s, signal.SIG_IGN if ignore else h)
    _start_held.clear()


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
    if not _in_main_thread():
        yield
        return
    ours = {s: signal.getsignal(s) for s in raising_signals()}  # not an outer hold's either
    held: list[int] = []
    for s in ours:
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, h in ours.items():
            signal.signal(s, h)
    if held:
        raise as_interrupt(held[0])


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (with ``signum``) like Ctrl+C, so the same
    clean-up runs; only in the main thread (where Python delivers signals). One that is ignored
    stays ignored (``nohup`` ignores SIGHUP so that a command outlives its terminal).

    After :func:`hold_signals_at_start` it takes the signals over for the block: Ctrl+C raises
    again, and the first signal that arrived since then is raised as the block begins."""
    if not _in_main_thread():
        yield
        return
    old: dict[int, object] = {}
    for s in _terminating():
        h = signal.getsignal(s)
        if h != signal.SIG_IGN:
            old[s] = h  # hold_signals_at_start's note, if it held it: noted again after the block
            signal.signal(s, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is _note_arrival and signal.SIGINT in _start_held:
        old[signal.SIGINT] = _note_arrival
        signal.signal(signal.SIGINT, _start_held[signal.SIGINT])  # Ctrl+C raises again
    try:
        if _arrived:  # since hold_signals_at_start: raised here, where the caller handles it
            first = _arrived[0]
            _arrived.clear()
            raise as_interrupt(first)
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class MemoryBudgetError(DGemmaError, MemoryError):
    """A prompt's KV cache and working memory would not fit in the memory available."""
