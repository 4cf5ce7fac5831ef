"""``mlx-dgemma chat``: the Textual app."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from textual.app import App

from .engine import Engine, Job, ModelBackend


class DGemmaApp(App):
    CSS_PATH = "dgemma.tcss"
    TITLE = "mlx-dgemma"
    BINDINGS = [("ctrl+q", "quit", "Quit")]

    def __init__(self, backend: Any | None = None, trace_dir: str | Path = ".", **kw):
        super().__init__(**kw)
        self.backend = backend
        self.engine: Engine | None = None
        self.trace_dir = Path(trace_dir)
        self.last_export: Path | None = None

    def on_mount(self) -> None:
        if self.backend is None:
            from .screens.welcome import WelcomeScreen

            self.push_screen(WelcomeScreen())
        else:
            self._start()

    def start_demo(self) -> None:
        self.backend = ModelBackend(demo=True)
        self.pop_screen()
        self._start()

    def _start(self) -> None:
        from .screens.chat import ChatScreen

        self.chat_screen = ChatScreen()
        # post_message is thread-safe and does not block the engine on the UI
        self.engine = Engine(self.backend, self.chat_screen.post_message)
        self.push_screen(self.chat_screen)
        self._engine_worker()
        self.engine.submit(Job("load"))

    def _engine_worker(self) -> None:
        """The one thread that runs MLX for the whole session (see engine.py). A daemon thread,
        not a Textual thread worker: those run in asyncio's default executor, which the app's
        exit joins, so a stuck load or template render would keep Ctrl+Q from quitting."""
        threading.Thread(target=self.engine.run, name="mlx-dgemma-engine", daemon=True).start()

    def on_unmount(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def configured_model() -> str | None:
    return os.environ.get("MLX_DGEMMA_MODEL") or None


def run_app(model: str | None = None, demo: bool = False, dtype: str = "float32") -> int:
    model = model or (None if demo else configured_model())
    backend = ModelBackend(model=model, demo=demo, dtype=dtype) if (model or demo) else None
    if model and not Path(model).exists():
        from ..errors import ModelFilesError

        raise ModelFilesError(f"{model}: no such file or directory; give a .gguf file or a directory written "
                              "by `mlx-dgemma convert`")
    DGemmaApp(backend).run()
    return 0
