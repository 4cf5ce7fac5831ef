"""One long-lived worker thread that owns the model: every MLX call (loading, prefill,
denoising) happens on it, in order. The UI sends jobs; results come back as messages.

The backend is anything with ``load(progress)``, ``stream(prompt, cancel, **params)``,
``reset()``, ``memory_bytes()``, ``label`` and ``is_demo``; tests plug in a scripted one.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mlx_dgemma.errors import DGemmaError


@dataclass
class Job:
    kind: str  # "load" | "generate" | "reset" | "stop"
    prompt: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    answer_id: int = 0


class ModelBackend:
    """The real model behind a :class:`mlx_dgemma.ChatSession`."""

    def __init__(self, model: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto"):
        self.model_path, self.demo, self.dtype, self.precision = model, demo, dtype, precision
        self.session = None
        self.tokenizer = None
        self.generation_config: dict = {}
        self.label = "demo model (tiny, trained on the KJV Bible)" if demo else str(model)
        self.is_demo = demo
        self.canvas_length = 0

    def load(self, progress: Callable[[str], None]) -> None:
        from mlx_dgemma.generation import ChatSession
        from mlx_dgemma.precision import resolve_precision

        prec = resolve_precision(self.precision, self.dtype)
        if self.demo:
            from mlx_dgemma.demo import load_demo

            progress("loading the demo model")
            model, tok = load_demo(precision=prec)
        else:
            from mlx_dgemma.loader import load

            model, tok = load(self.model_path, precision=prec,
                              progress=lambda i, n, name: progress(f"loading {i}/{n} {name}"))
        self.tokenizer = tok
        self.generation_config = dict(getattr(model, "generation_config", {}) or {})
        self.canvas_length = model.args.canvas_length
        self.precision_label = prec.label
        self.session = ChatSession(model, tok, self.generation_config)

    def stream(self, prompt: str, cancel: Callable[[], bool], **params: Any) -> Iterator[Any]:
        yield from self.session.stream(prompt, cancel=cancel, **params)

    def reset(self) -> None:
        if self.session is not None:
            self.session.reset()

    def piece(self, token_id: int) -> str:
        return self.tokenizer.piece(token_id) if self.tokenizer else str(token_id)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def memory_bytes(self) -> int:
        import mlx.core as mx

        from mlx_dgemma.generation import current_rss_bytes

        active = int(mx.get_active_memory()) if hasattr(mx, "get_active_memory") else 0
        return active if active > 64 << 20 else current_rss_bytes()


class Engine:
    """The job loop. ``run`` is the body of the app's single exclusive thread worker."""

    def __init__(self, backend: Any, post: Callable[[Any], None]):
        from .messages import EngineError, EngineEvent, EngineStatus

        self.backend = backend
        self._post = post
        self._jobs: queue.Queue[Job] = queue.Queue()
        self.cancel_flag = threading.Event()
        self._status, self._event, self._error = EngineStatus, EngineEvent, EngineError
        self.loaded = False

    def submit(self, job: Job) -> None:
        if job.kind == "generate":
            self.cancel_flag.clear()
        self._jobs.put(job)

    def cancel(self) -> None:
        self.cancel_flag.set()

    def stop(self) -> None:
        self.cancel_flag.set()
        self._jobs.put(Job("stop"))

    def run(self) -> None:
        while True:
            job = self._jobs.get()
            if job.kind == "stop":
                return
            try:
                self._do(job)
            except Exception as e:  # shown in the app; the loop keeps serving
                # our own errors are written for the user; anything else gets its type name
                message = str(e) if isinstance(e, DGemmaError) else f"{type(e).__name__}: {e}"
                if job.kind == "load":
                    self._post(self._status("failed", message))  # the app offers what to do
                else:
                    self._post(self._error(message, job.answer_id if job.kind == "generate" else None))
                    self._post(self._status("ready"))

    def _do(self, job: Job) -> None:
        if job.kind == "load":
            self._post(self._status("loading", self.backend.label))
            self.backend.load(lambda detail: self._post(self._status("loading", detail)))
            self.loaded = True
            self._post(self._status("ready", self.backend.label))
        elif job.kind == "reset":
            self.backend.reset()
        elif job.kind == "generate":
            if not self.loaded:
                return  # queued while a load was failing; the app has left the chat
            self._post(self._status("busy"))
            for ev in self.backend.stream(job.prompt, self.cancel_flag.is_set, **job.params):
                self._post(self._event(ev, job.answer_id))
            self._post(self._status("ready"))
