"""The chat app's side of the core's model host (:class:`mlx_dgemma.host.ModelHost`, the one
the server uses too): the load, answer and new-chat jobs of a :class:`Backend` run on its
worker thread, in order, and their results come back to the UI as Textual messages; the
model's facts (:class:`~mlx_dgemma.host.ModelInfo`) and its memory, sampled on that thread,
are the host's, read by the UI without calling MLX.

The engine and the screens reach the model only through :class:`Backend`; the real one is
:class:`ModelBackend`, tests plug in a scripted one (tests/tui_fakes.py) with no MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from textual.message import Message

from mlx_dgemma.errors import DGemmaError
from mlx_dgemma.events import DoneEvent, Event
from mlx_dgemma.host import ModelHost, ModelInfo
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.worker import ModelWorker, Ticket, WorkerStopped

from .messages import EngineError, EngineEvent, EngineStatus

if TYPE_CHECKING:
    from mlx_dgemma.plan import Plan


@runtime_checkable
class Backend(Protocol):
    """What the chat app needs from a model. ``load``, ``stream`` and ``memory_bytes`` run on the
    engine thread; the attributes and ``piece``/``decode`` are read by the UI (no MLX work)."""

    label: str  # what the model is, for the status line and errors: a path, or the demo's name
    is_demo: bool  # shows the demo banner
    info: ModelInfo | None  # the loaded model's facts (known once loaded; the host hands them to the UI)
    think: bool  # the thought channel at start (``--think``); the settings screen can change it
    system: str | None  # the system prompt at start (``--system``); each new chat takes the current one
    sampler: dict[str, Any]  # the sampler overrides at start (``--quality``); the settings screen changes them

    def load(self, progress: Callable[[str], None]) -> None:
        """Load the model, reporting progress as short lines; raise DGemmaError to fail."""

    def stream(self, prompt: str, cancel: Callable[[], bool], think: bool = False,
               request: GenerationRequest | None = None) -> Iterator[Event]:
        """The next turn of the conversation as ``stream_generate`` events; stop at ``cancel()``.
        ``think``: enable the thought channel for this turn; ``request``: its settings."""

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation (a new chat), which starts with ``system`` as its system prompt."""

    def close(self) -> None:
        """The app quits; called once, on the engine thread, after its last job (under
        ``mlx.launch`` the real backend tells the other ranks to leave here)."""

    def memory_bytes(self) -> int:
        """Memory the process holds now (on the engine thread: the host samples it there)."""

    def sc_top_k(self, params: Any) -> int | None:
        """The self-conditioning top-k an answer under ``params`` (SamplerParams) runs with, for
        the trace's header (the loaded precision's unless ``params`` sets one)."""

    def piece(self, token_id: int) -> str:
        """One token's text, for the canvas."""

    def decode(self, ids: list[int]) -> str:
        """Token ids to text, for the trace export."""


class ModelBackend:
    """The real model behind a :class:`mlx_dgemma.ChatSession` (a :class:`Backend`), run through
    the core's :class:`mlx_dgemma.lockstep.ModelRuntime`: in one process it calls the session
    directly; under ``mlx.launch`` it first tells the other ranks (which follow it) each call."""

    def __init__(self, model: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto", think: bool = False, system: str | None = None,
                 memory_limit: int | None = None, sampler: dict[str, Any] | None = None,
                 plan: Plan | None = None):
        self.model_path, self.demo, self.dtype, self.precision = model, demo, dtype, precision
        self.plan = plan  # the command line's memory plan (mlx_dgemma.loader.plan_load): the load reads it
        self.memory_limit = memory_limit  # --memory-limit: the load's and every answer's budget
        self.think, self.system = think, system or None
        self.sampler = dict(sampler or {})  # the sampler overrides to start with (chat --quality)
        self.runtime = None  # the ModelRuntime, once loaded
        self.tokenizer = None
        self.info: ModelInfo | None = None
        self.label = "demo model (tiny, trained on the KJV Bible)" if demo else str(model)
        self.is_demo = demo

    def load(self, progress: Callable[[str], None]) -> None:
        from mlx_dgemma.loader import open_model
        from mlx_dgemma.lockstep import ModelRuntime

        if self.demo:
            progress("loading the demo model")
        runtime = open_model(self.model_path, self.demo, self.precision, self.dtype,
                             progress=lambda i, n, name: progress(f"loading {i}/{n} {name}"),
                             memory_limit=self.memory_limit, plan=self.plan)
        self.tokenizer = runtime.tokenizer
        self.info = ModelInfo.of(runtime, self.label)
        self.runtime = ModelRuntime(runtime)
        self.runtime.new_chat(enable_thinking=self.think, system=self.system)

    @property
    def session(self):
        """The conversation's :class:`mlx_dgemma.ChatSession` (None before the load)."""
        return self.runtime.session if self.runtime is not None else None

    def stream(self, prompt: str, cancel: Callable[[], bool], think: bool = False,
               request: GenerationRequest | None = None) -> Iterator[Event]:
        # per turn: a follow-up's markup says whether to think
        yield from self.runtime.chat(prompt, request, cancel=cancel, enable_thinking=think)

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

    def sc_top_k(self, params: Any) -> int | None:
        return self.runtime.runtime.sc_top_k(params) if self.runtime is not None else params.sc_top_k

    def memory_bytes(self) -> int:
        from mlx_dgemma.memory import memory_bytes

        return memory_bytes()


def describe_error(e: Exception) -> str:
    """Our own errors (:class:`DGemmaError` and its subclasses) are written for the user and
    shown as they are; anything else is a bug or a library's error: its type name says which."""
    return str(e) if isinstance(e, DGemmaError) else f"{type(e).__name__}: {e}"


class ChatEngine:
    """A :class:`ModelHost` serving one :class:`Backend`, and the messages the chat screen
    reads: every state change (:class:`EngineStatus`), each event of an answer
    (:class:`EngineEvent`), failures (:class:`EngineError`). ``post`` is thread-safe
    (``Screen.post_message``): the worker never waits for the UI.

    The host and its worker loop are the core's; what stays here is what only the chat app needs
    and the core must not know (Textual's messages, the job kinds, which answer an event
    belongs to), so that the screens call methods, not the worker.

    :meth:`stop` ends the worker at its next safe point: between denoising steps or prefill
    chunks (the answer's ticket is cancelled, and ``stream_generate`` polls it), between
    tensors of a load (the progress report checks :attr:`ModelWorker.stopping`), or before
    the next queued job. The app then waits for :meth:`join` before the interpreter exits:
    MLX must not be running on the thread then (that aborted the process)."""

    def __init__(self, backend: Backend, post: Callable[[Message], None]):
        self.backend = backend
        self._post = post
        self.host = ModelHost(self._load, loaded=self._loaded, name="mlx-dgemma-engine", finish=self._close,
                              memory=backend.memory_bytes)
        self.loaded = False
        self._answer: Ticket | None = None  # the last answer's job: what Escape cancels

    # the UI's side -----------------------------------------------------------------------
    @property
    def worker(self) -> ModelWorker[ModelInfo]:
        """The host's worker thread."""
        return self.host.worker

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts (None until it is loaded)."""
        return self.host.info

    @property
    def memory_bytes(self) -> int:
        """The process's memory, sampled on the worker at the load and during an answer (at most 15 Hz)."""
        return self.host.memory_bytes

    def start(self) -> None:
        """Start the worker; the load runs on it and reports as "loading", then "ready" or "failed"."""
        self.host.launch()

    def generate(self, prompt: str, request: GenerationRequest, answer_id: int, think: bool = False) -> None:
        """Queue the next turn (``think``: with the thought channel); its events come back
        tagged with ``answer_id``."""
        self._answer = self._submit(lambda t: self._generate(t, prompt, request, answer_id, think),
                                    skipped=lambda t: self._not_started(answer_id))

    def reset(self, system: str | None) -> None:
        """Queue a new chat, with ``system`` as its system prompt (after the answer under way, if any)."""
        self._submit(lambda t: self._reset(system))

    def cancel(self) -> None:
        """Escape: the answer stops at its next step or prefill chunk (or never starts)."""
        if self._answer is not None:
            self._answer.cancel()

    def stop(self) -> None:
        """Ask the worker to stop at its next safe point; does not wait (see :meth:`join`)."""
        self.host.stop(timeout=0)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the worker thread to end; whether it has."""
        return self.host.join(timeout)

    @property
    def running(self) -> bool:
        """The worker thread is alive (it may be finishing a step after :meth:`stop`)."""
        return self.host.running

    def _submit(self, run: Callable[[Ticket], None], **kw: Any) -> Ticket | None:
        try:
            return self.host.submit(run, **kw)
        except WorkerStopped:  # quitting, or the load failed: the chat is closing, nothing to run
            return None

    # the worker's side (every MLX call happens here) ---------------------------------------
    def _close(self) -> None:
        """The worker's last call, on its thread: a sharded model's other ranks leave."""
        self.backend.close()

    def _progress(self, detail: str) -> None:
        if self.host.stopping:  # Ctrl+Q while loading: give up between tensors
            raise WorkerStopped("stopped while loading")
        self._post(EngineStatus("loading", detail))

    def _load(self) -> ModelInfo:
        self._post(EngineStatus("loading", self.backend.label))
        try:
            self.backend.load(self._progress)
        except Exception as e:
            if not self.host.stopping:  # the app offers what to do
                self._post(EngineStatus("failed", describe_error(e)))
            raise  # the worker ends: the jobs queued meanwhile never run
        return self.backend.info  # type: ignore[return-value] - set by a load that returned

    def _loaded(self, info: ModelInfo) -> None:
        """On the worker, once the host holds ``info`` (what the chat screen reads from then on)."""
        self.loaded = True
        self._post(EngineStatus("ready", self.backend.label))

    def _generate(self, ticket: Ticket, prompt: str, request: GenerationRequest, answer_id: int,
                  think: bool) -> None:
        try:
            self._post(EngineStatus("busy"))
            events = self.backend.stream(prompt, lambda: ticket.cancelled, think=think, request=request)
            for ev in self.host.sampled(events):  # the memory the status line shows, sampled here
                self._post(EngineEvent(ev, answer_id))
        except Exception as e:  # noqa: BLE001 - shown in the app, never a crash; the worker goes on
            self._post(EngineError(describe_error(e), answer_id))
        self._post(EngineStatus("ready"))

    def _reset(self, system: str | None) -> None:
        try:
            self.backend.reset(system=system)
        except Exception as e:  # noqa: BLE001 - as an answer's error
            self._post(EngineError(describe_error(e)))
            self._post(EngineStatus("ready"))

    def _not_started(self, answer_id: int) -> None:
        """An answer cancelled while it waited (Escape on a message sent during the load): it
        never runs, but the screen still hears that it ended, so it does not stay "answering"."""
        if self.host.stopping or not self.loaded:
            return  # quitting, or the load failed: the chat screen is gone
        done = DoneEvent.cancelled(peak_memory_bytes=self.host.sample_memory(), precision=self.host.info.precision)
        self._post(EngineEvent(done, answer_id))
        self._post(EngineStatus("ready"))
