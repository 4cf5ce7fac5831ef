"""One long-lived worker thread that owns the model: every MLX call (loading, prefill,
denoising) happens on it, in order. The UI sends jobs; results come back as messages.

The engine and the screens reach the model only through :class:`Backend`; the real one is
:class:`ModelBackend`, tests plug in a scripted one (tests/tui_fakes.py) with no MLX.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from textual.message import Message

from mlx_dgemma.errors import DGemmaError
from mlx_dgemma.events import Event

from .messages import EngineError, EngineEvent, EngineStatus


@runtime_checkable
class Backend(Protocol):
    """What the chat app needs from a model. ``load`` and ``stream`` run on the engine thread;
    the attributes and ``piece``/``decode``/``memory_bytes`` are read by the UI (no MLX work)."""

    label: str  # what the model is, for the status line and errors: a path, or the demo's name
    is_demo: bool  # shows the demo banner
    canvas_length: int  # tokens per block (known once loaded)
    precision_label: str  # the runtime precision, e.g. "fast (bfloat16)" (known once loaded)
    generation_config: dict[str, Any]  # the model's sampler defaults (known once loaded)
    think: bool  # the thought channel at start (``--think``); the settings screen can change it
    system: str | None  # the system prompt at start (``--system``); each new chat takes the current one

    def load(self, progress: Callable[[str], None]) -> None:
        """Load the model, reporting progress as short lines; raise DGemmaError to fail."""

    def stream(self, prompt: str, cancel: Callable[[], bool], think: bool = False,
               **params: Any) -> Iterator[Event]:
        """The next turn of the conversation as ``stream_generate`` events; stop at ``cancel()``.
        ``think``: enable the thought channel for this turn; ``params``: sampler overrides."""

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation (a new chat), which starts with ``system`` as its system prompt."""

    def memory_bytes(self) -> int:
        """Memory the process holds now."""

    def piece(self, token_id: int) -> str:
        """One token's text, for the canvas."""

    def decode(self, ids: list[int]) -> str:
        """Token ids to text, for the trace export."""


@dataclass
class Job:
    kind: str  # "load" | "generate" | "reset" | "stop"
    prompt: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    answer_id: int = 0


class ModelBackend:
    """The real model behind a :class:`mlx_dgemma.ChatSession` (a :class:`Backend`), run through
    the core's :class:`mlx_dgemma.lockstep.ModelRuntime`: in one process it calls the session
    directly; under ``mlx.launch`` it first tells the other ranks (which follow it) each call."""

    def __init__(self, model: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto", think: bool = False, system: str | None = None):
        self.model_path, self.demo, self.dtype, self.precision = model, demo, dtype, precision
        self.think, self.system = think, system or None
        self.model = None
        self.runtime = None  # the ModelRuntime, once loaded
        self.tokenizer = None
        self.generation_config: dict[str, Any] = {}
        self.label = "demo model (tiny, trained on the KJV Bible)" if demo else str(model)
        self.is_demo = demo
        self.canvas_length = 0
        self.precision_label = ""

    def load(self, progress: Callable[[str], None]) -> None:
        from mlx_dgemma.generation import precision_label
        from mlx_dgemma.loader import open_model
        from mlx_dgemma.lockstep import ModelRuntime

        if self.demo:
            progress("loading the demo model")
        model, tok = open_model(self.model_path, self.demo, self.precision, self.dtype,
                                progress=lambda i, n, name: progress(f"loading {i}/{n} {name}"))
        self.tokenizer = tok
        self.generation_config = dict(getattr(model, "generation_config", {}) or {})
        self.canvas_length = model.args.canvas_length
        self.precision_label = precision_label(model)
        self.model = model
        self.runtime = ModelRuntime(model, tok, self.generation_config)
        self.runtime.new_chat(enable_thinking=self.think, system=self.system)

    @property
    def session(self):
        """The conversation's :class:`mlx_dgemma.ChatSession` (None before the load)."""
        return self.runtime.session if self.runtime is not None else None

    def stream(self, prompt: str, cancel: Callable[[], bool], think: bool = False,
               **params: Any) -> Iterator[Event]:
        # per turn: a follow-up's markup says whether to think
        yield from self.runtime.chat(prompt, cancel=cancel, enable_thinking=think, **params)

    def reset(self, system: str | None = None) -> None:
        self.system = system or None
        if self.runtime is not None:  # the system prompt opens the cache: a new session, not an edit
            self.runtime.new_chat(enable_thinking=self.session.enable_thinking, system=self.system)

    def close(self) -> None:
        """The app quits (on the engine thread): under mlx.launch the other ranks leave too."""
        if self.runtime is not None:
            self.runtime.shutdown()

    def piece(self, token_id: int) -> str:
        return self.tokenizer.piece(token_id) if self.tokenizer else str(token_id)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def memory_bytes(self) -> int:
        from mlx_dgemma.memory import memory_bytes

        return memory_bytes()


def describe_error(e: Exception) -> str:
    """Our own errors (:class:`DGemmaError` and its subclasses) are written for the user and
    shown as they are; anything else is a bug or a library's error: its type name says which."""
    return str(e) if isinstance(e, DGemmaError) else f"{type(e).__name__}: {e}"


class _Stopped(Exception):
    """Raised inside a load (at its next progress report) once the app has asked the engine to stop."""


class Engine:
    """The job loop. ``run`` is the body of the app's single engine thread.

    :meth:`stop` ends it at the next safe point: between denoising steps or prefill chunks
    (through the cancel check ``stream_generate`` polls), between tensors of a load, or
    before the next queued job. The app joins the thread before the interpreter exits: MLX
    must not be running on it then (that aborted the process)."""

    def __init__(self, backend: Backend, post: Callable[[Message], None]):
        self.backend = backend
        self._post = post
        self._jobs: queue.Queue[Job] = queue.Queue()
        self.cancel_flag = threading.Event()
        self.stopping = threading.Event()  # set once, by stop(): the loop ends
        self.loaded = False

    def submit(self, job: Job) -> None:
        if job.kind == "generate":
            self.cancel_flag.clear()
        self._jobs.put(job)

    def cancel(self) -> None:
        self.cancel_flag.set()

    def stop(self) -> None:
        self.stopping.set()
        self.cancel_flag.set()
        self._jobs.put(Job("stop"))  # wakes the loop if it is waiting for a job

    def _cancelled(self) -> bool:
        return self.cancel_flag.is_set() or self.stopping.is_set()

    def _progress(self, detail: str) -> None:
        if self.stopping.is_set():
            raise _Stopped
        self._post(EngineStatus("loading", detail))

    def run(self) -> None:
        try:
            self._loop()
        finally:  # the backend's last call, on this thread: a sharded model's other ranks leave
            close = getattr(self.backend, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - quitting: the other ranks' loss, said there
                    pass

    def _loop(self) -> None:
        while not self.stopping.is_set():
            job = self._jobs.get()
            if job.kind == "stop" or self.stopping.is_set():
                return
            try:
                self._do(job)
            except _Stopped:
                return
            except Exception as e:  # shown in the app; the loop keeps serving
                if job.kind == "load":
                    self._post(EngineStatus("failed", describe_error(e)))  # the app offers what to do
                else:
                    self._post(EngineError(describe_error(e), job.answer_id if job.kind == "generate" else None))
                    self._post(EngineStatus("ready"))

    def _do(self, job: Job) -> None:
        if job.kind == "load":
            self._post(EngineStatus("loading", self.backend.label))
            self.backend.load(self._progress)
            self.loaded = True
            self._post(EngineStatus("ready", self.backend.label))
        elif job.kind == "reset":
            self.backend.reset(**job.params)
        elif job.kind == "generate":
            if not self.loaded:
                return  # queued while a load was failing; the app has left the chat
            self._post(EngineStatus("busy"))
            for ev in self.backend.stream(job.prompt, self._cancelled, **job.params):
                self._post(EngineEvent(ev, job.answer_id))
            self._post(EngineStatus("ready"))
