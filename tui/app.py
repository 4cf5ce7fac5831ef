"""``mlx-dgemma chat``: the Textual app."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from textual.app import App

from mlx_dgemma.paths import user_path

from .engine import Backend, Engine, Job, ModelBackend

LOAD_FAILED_EXIT = 2  # the exit status when the user quits while no model could be loaded


class DGemmaApp(App):
    CSS_PATH = "dgemma.tcss"
    TITLE = "mlx-dgemma"
    BINDINGS = [("ctrl+q", "quit", "Quit")]

    def __init__(self, backend: Backend | None = None, trace_dir: str | Path = ".", **kw):
        super().__init__(**kw)
        self.backend = backend
        self.engine: Engine | None = None
        self.trace_dir = Path(trace_dir)
        self.last_export: Path | None = None
        self.load_error: str | None = None  # set while the model could not be loaded

    def on_mount(self) -> None:
        if self.backend is None:
            from .screens.welcome import WelcomeScreen

            self.push_screen(WelcomeScreen())
        else:
            self._start()

    def start_demo(self) -> None:
        self.backend = ModelBackend(demo=True)
        self.load_error = None
        self.pop_screen()
        self._start()

    def load_failed(self, message: str) -> None:
        """The model could not be loaded: leave the chat (there is nothing to talk to) for the
        welcome screen, which shows the error, how to get a model, and the demo."""
        from .screens.chat import ChatScreen
        from .screens.welcome import WelcomeScreen

        if self.load_error is not None:
            return
        self.load_error = message
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        if isinstance(self.screen, ChatScreen):
            self.pop_screen()
        self.push_screen(WelcomeScreen(error=message, model=self.backend.label if self.backend is not None else None))

    def _start(self) -> None:
        from .screens.chat import ChatScreen

        self.chat_screen = ChatScreen()
        # post_message is thread-safe and does not block the engine on the UI
        self.engine = Engine(self.backend, self.chat_screen.post_message)
        self.push_screen(self.chat_screen)
        self._engine_worker(self.engine)
        self.engine.submit(Job("load"))

    def _engine_worker(self, engine: Engine) -> None:
        """The one thread that runs MLX for the whole session (see engine.py). A daemon thread,
        not a Textual thread worker: those run in asyncio's default executor, which the app's
        exit joins, so a stuck load or template render would keep Ctrl+Q from quitting."""
        threading.Thread(target=engine.run, name="mlx-dgemma-engine", daemon=True).start()

    async def action_quit(self) -> None:
        self.exit(return_code=LOAD_FAILED_EXIT if self.load_error is not None else 0)

    def on_unmount(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def configured_model() -> str | None:
    """``MLX_DGEMMA_MODEL``, with ``~`` and variables expanded (no shell expands it for us)."""
    value = os.environ.get("MLX_DGEMMA_MODEL", "").strip()
    return str(user_path(value)) if value else None


def run_app(model: str | None = None, demo: bool = False, dtype: str | None = None,
            precision: str = "auto") -> int:
    """Run the chat app; the exit status is non-zero if the user quits with no model loaded."""
    from mlx_dgemma.errors import ModelFilesError

    from_env = not model and not demo
    model = str(user_path(model)) if model else (configured_model() if from_env else None)
    backend = ModelBackend(model=model, demo=demo, dtype=dtype, precision=precision) if (model or demo) else None
    if model and not demo and not Path(model).exists():
        source = " (from MLX_DGEMMA_MODEL)" if from_env else ""
        raise ModelFilesError(f"{model}{source}: no such file or directory; give a .gguf file or a directory "
                              "written by `mlx-dgemma convert`")
    app = DGemmaApp(backend)
    app.run()
    if app.load_error is not None:
        print(f"mlx-dgemma chat: error: {app.load_error}", file=sys.stderr)
    return app.return_code or 0
