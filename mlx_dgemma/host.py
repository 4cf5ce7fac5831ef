"""The model a front end holds: loaded on its own worker thread, with its facts.

Both front ends (the server's :class:`mlx_dgemma.server.engine.Engine`, the chat app's
:class:`mlx_dgemma.tui.engine.ChatEngine`) hold one :class:`ModelHost`: the core's
:class:`~mlx_dgemma.worker.ModelWorker` (the one thread every MLX call of the model runs on),
the load that runs first on it (the front end's: ``loader.open_model`` with its own progress
report, then a :class:`~mlx_dgemma.lockstep.ModelRuntime`), the model's facts once loaded
(:class:`ModelInfo`) and the memory the process holds, sampled on that thread. A front end submits its requests as jobs
(:meth:`ModelHost.submit`), cancels them through their tickets, and reads the facts and the
memory from any thread without calling MLX.

The path of a request: front end → :meth:`ModelHost.submit` → the worker's thread →
:class:`~mlx_dgemma.lockstep.ModelRuntime` (every rank, under ``mlx.launch``) →
``stream_generate`` / :class:`~mlx_dgemma.ChatSession`; events come back through the job.

:class:`ModelInfo` declares each fact once, with where it comes from in the loaded
:class:`~mlx_dgemma.runtime.Runtime`; the facts marked ``shown`` are shown by both front ends
(the server's ``/health``, the chat app's status line): a new one is one line here.
Importing this module imports no MLX (the chat app's fakes use :class:`ModelInfo`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from mlx_dgemma.worker import ModelWorker, Ticket

if TYPE_CHECKING:
    from mlx_dgemma.runtime import Runtime

E = TypeVar("E")
# a stream's memory is sampled at most this often (the chat app redraws at 15 Hz): a sample costs
# 0.28 ms on Linux's CPU backend (/proc), a step of the demo model a few ms
MEMORY_SAMPLE_S = 1 / 15


def fact(of: Callable[[Runtime], Any], *, shown: bool | str = False, default: Any = MISSING) -> Any:
    """A field of :class:`ModelInfo`: ``of(runtime)`` is its value once loaded; ``shown``: both
    front ends show it (the server's /health by its name, the chat app's status line as the value,
    or in words: a format such as ``"{} layers"``); ``default``: its value in a ModelInfo built by
    hand (a test's scripted model), for a fact added after the others."""
    return field(default=default, metadata={"of": of, "shown": shown})


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model's facts, as the front ends read them (from any thread: no MLX). Each is
    declared here once, with where it comes from; :meth:`of` reads them all from a Runtime."""

    name: str  # what the model is, for people: the path as given, or the demo's name (the front end's words)
    precision: str = fact(lambda rt: rt.precision.label, shown=True)  # e.g. "fast (bfloat16)"
    demo: str | None = fact(lambda rt: rt.demo_kind)  # "trained" | "random" for the built-in demo; None
    canvas_length: int = fact(lambda rt: int(rt.model.args.canvas_length))  # tokens per block
    context_length: int = fact(lambda rt: int(rt.model.args.max_position_embeddings))
    vocab_size: int = fact(lambda rt: int(rt.model.args.vocab_size))
    # the model's sampler defaults (read-only: a front end copies it to change it)
    generation_config: Mapping[str, Any] = fact(lambda rt: MappingProxyType(dict(rt.generation_config)))

    @classmethod
    def of(cls, runtime: Runtime, name: str) -> ModelInfo:
        """The facts of ``runtime``, a model called ``name``."""
        return cls(name=name, **{f.name: f.metadata["of"](runtime) for f in fields(cls) if "of" in f.metadata})

    def shown(self) -> dict[str, Any]:
        """The facts both front ends show, by field name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("shown")}

    def shown_words(self) -> list[str]:
        """The same facts in words, for a status line (those without a value left out)."""
        words = []
        for f in fields(self):
            how, value = f.metadata.get("shown"), getattr(self, f.name)
            if how and value not in (None, ""):
                words.append(how.format(value) if isinstance(how, str) else str(value))
        return words


def _process_memory() -> int:
    from mlx_dgemma.memory import memory_bytes

    return memory_bytes()


class ModelHost:
    """A model on its own worker thread, for a front end: :meth:`launch` or :meth:`start` runs
    ``load`` there (it returns the model's :class:`ModelInfo`), :meth:`submit` queues a job
    (cancelled through its :class:`~mlx_dgemma.worker.Ticket`), :meth:`stop` ends the thread
    after ``finish`` ran on it. :attr:`info` and :attr:`memory_bytes` are plain values, set on the
    worker's thread and read from any other: the one-thread rule holds (every MLX call of the
    model on the worker's thread, memory's included).

    ``loaded(info)``: called on the worker once :attr:`info` is set (the chat app says "ready" there).
    ``memory``: how to sample the process's memory (on the worker; MLX's count by default).
    ``max_waiting``, ``name``, ``finish``: the worker's (:class:`~mlx_dgemma.worker.ModelWorker`).
    """

    def __init__(self, load: Callable[[], ModelInfo], *, loaded: Callable[[ModelInfo], None] | None = None,
                 finish: Callable[[], None] | None = None, max_waiting: int | None = None,
                 name: str = "mlx-dgemma-host", memory: Callable[[], int] | None = None):
        self._open, self._loaded = load, loaded
        self._memory = memory or _process_memory
        self.info: ModelInfo | None = None  # once loaded
        self.memory_bytes = 0  # the process's memory at the last sample (after the load, each turn, each event)
        self.worker: ModelWorker[ModelInfo] = ModelWorker(self._load, max_waiting=max_waiting, name=name,
                                                          finish=finish)

    # the worker's side ----------------------------------------------------------------------
    def _load(self) -> ModelInfo:
        info = self._open()
        self.sample_memory()
        self.info = info
        if self._loaded is not None:
            self._loaded(info)
        return info

    def sample_memory(self) -> int:
        """Sample the process's memory now (on the worker's thread only: it asks MLX)."""
        self.memory_bytes = self._memory()
        return self.memory_bytes

    def sampled(self, events: Iterator[E]) -> Iterator[E]:
        """``events`` as they are, the memory sampled before one is handed on (the first, then at
        most every :data:`MEMORY_SAMPLE_S`), on the worker's thread where the generator runs: a UI
        shows it live without calling MLX itself."""
        last = None
        for ev in events:
            now = time.monotonic()
            if last is None or now - last >= MEMORY_SAMPLE_S:
                self.sample_memory()
                last = now
            yield ev

    def _turn(self, run: Callable[[Ticket], Any]) -> Callable[[Ticket], Any]:
        def turn(ticket: Ticket) -> Any:
            try:
                return run(ticket)
            finally:
                self.sample_memory()  # after each turn: what /health and /metrics report
        return turn

    # the front end's side -------------------------------------------------------------------
    def shown(self) -> dict[str, Any]:
        """The facts both front ends show (:meth:`ModelInfo.shown`); each None before the load."""
        if self.info is not None:
            return self.info.shown()
        return {f.name: None for f in fields(ModelInfo) if f.metadata.get("shown")}

    def launch(self) -> None:
        """Start the worker; the load runs on it (and reports its own progress and failure)."""
        self.worker.launch()

    def start(self) -> ModelInfo:
        """Start the worker and wait for the load (its error is raised here)."""
        return self.worker.start()

    def submit(self, run: Callable[[Ticket], Any], *, skipped: Callable[[Ticket], None] | None = None,
               cancel: threading.Event | None = None, bypass_limit: bool = False) -> Ticket:
        """Queue a job for the worker (:meth:`ModelWorker.submit`); the memory is sampled after each of its turns."""
        return self.worker.submit(self._turn(run), skipped=skipped, cancel=cancel, bypass_limit=bypass_limit)

    def cancel_all(self) -> None:
        """Cancel the running job (at its next check) and every waiting one; the worker goes on."""
        self.worker.cancel_all()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel every job and end the worker (bounded; ``timeout=0`` only asks): whether it ended."""
        return self.worker.stop(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the worker's thread to end; whether it has."""
        return self.worker.join(timeout)

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: a load gives up at its next check of this."""
        return self.worker.stopping

    @property
    def running(self) -> bool:
        """The worker's thread is alive (it may be finishing a step after :meth:`stop`)."""
        return self.worker.running

    @property
    def alive(self) -> bool:
        """The worker takes jobs: loaded (or loading), not stopped."""
        return self.worker.alive

    @property
    def busy(self) -> bool:
        return self.worker.busy

    @property
    def waiting(self) -> int:
        return self.worker.waiting
