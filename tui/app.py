"""``mlx-dgemma chat``: the Textual app."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from mlx_dgemma.launch import need_terminal
from mlx_dgemma.paths import configured_model, user_path

from .engine import Backend, ChatEngine, ModelBackend

if TYPE_CHECKING:
    from mlx_dgemma.plan import Plan

LOAD_FAILED_EXIT = 2  # the exit status when the user quits while no model could be loaded
# How long Ctrl+Q waits for the engine to finish its current step (or tensor of a load) and
# stop. A demo step takes ~1 s on a CPU; a real model's step a few seconds at worst.
QUIT_WAIT_S = 15.0


class DGemmaApp(App):
    CSS_PATH = "dgemma.tcss"
    TITLE = "mlx-dgemma"
    # priority: Ctrl+Q quits from a modal screen too (the settings dialog would otherwise swallow it)
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]
    NOTIFICATION_TIMEOUT = 3  # seconds (Textual's 5 left toasts over the chart long after they were read)

    # Ctrl+Q pressed: the engine is asked to stop and the app waits for it; the chat screen's
    # status line says so (watch_stopping) and takes no more engine messages.
    stopping: reactive[bool] = reactive(False, init=False)

    def __init__(self, backend: Backend | None = None, trace_dir: str | Path = ".", **kw):
        super().__init__(**kw)
        self.backend = backend
        self.engine: ChatEngine | None = None
        self.trace_dir = Path(trace_dir)
        self.last_export: Path | None = None
        self.load_error: str | None = None  # set while the model could not be loaded
        self.engines: list[ChatEngine] = []  # every engine started (a failed load leaves one, maybe still stopping)
        self.signals: list[int] = []  # SIGINT/SIGTERM/SIGHUP received (run_app's _signals_end_app): the app exits

    def on_mount(self) -> None:
        if self.signals:  # one came before the event loop ran
            self.exit()
            return
        if self.backend is None:
            from .screens.welcome import WelcomeScreen

            self.push_screen(WelcomeScreen())
        else:
            self._start()

    def start_demo(self) -> None:
        old = self.backend  # the chat options given on the command line carry over to the demo
        self.backend = ModelBackend(demo=True, think=getattr(old, "think", False), system=getattr(old, "system", None),
                                    sampler=getattr(old, "sampler", None))
        self.load_error = None
        self.pop_screen()
        self._start()

    def load_failed(self, message: str) -> None:
        """The model could not be loaded: leave the chat (there is nothing to talk to) for the
        welcome screen, which shows the error, how to get a model, and the demo."""
        from .screens.chat import ChatScreen
        from .screens.welcome import WelcomeScreen

        from mlx_dgemma.launch import launched

        if self.load_error is not None:
            return
        self.load_error = message
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        if launched():  # under mlx.launch the other ranks load what rank 0 does: no demo to offer
            self.exit(return_code=LOAD_FAILED_EXIT)
            return
        if isinstance(self.screen, ChatScreen):
            self.pop_screen()
        self.push_screen(WelcomeScreen(error=message, model=self.backend.label if self.backend is not None else None))

    def _start(self) -> None:
        from .screens.chat import ChatScreen

        self.chat_screen = ChatScreen()
        # post_message is thread-safe and does not block the engine on the UI
        self.engine = ChatEngine(self.backend, self.chat_screen.post_message)
        self.push_screen(self.chat_screen)
        # The core's ModelWorker runs MLX for the whole session on its own daemon thread, not
        # a Textual thread worker: those run in asyncio's default executor, which the app's
        # exit joins, so a stuck load or template render would keep Ctrl+Q from quitting.
        self.engines.append(self.engine)
        self.engine.start()

    def engine_running(self) -> bool:
        return any(e.running for e in self.engines)

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def join_engine(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every engine thread to end; whether they all did."""
        end = time.monotonic() + timeout
        for e in self.engines:
            e.join(max(0.0, end - time.monotonic()))
        return not self.engine_running()

    async def action_quit(self) -> None:
        """Stop the engine, wait (bounded) until its thread has left MLX, then exit: an
        interpreter that shuts down while the thread runs MLX aborts the process."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_engine()
        if self.engine_running():
            end = time.monotonic() + QUIT_WAIT_S
            while self.engine_running() and time.monotonic() < end:
                await asyncio.sleep(0.02)
        self.exit(return_code=LOAD_FAILED_EXIT if self.load_error is not None else 0)

    def watch_stopping(self, stopping: bool) -> None:
        from .screens.chat import ChatScreen
        from .widgets.status import StatusLine

        if not stopping:
            return
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                # an answer stops at its next step; a load between tensors, nothing else has a step
                screen.query_one(StatusLine).update("stopping… (finishing the current step)" if screen.busy
                                                    else "stopping…")

    def on_unmount(self) -> None:
        self.stop_engine()


@contextmanager
def _signals_end_app(app: DGemmaApp) -> Iterator[None]:
    """``kill -INT``, SIGTERM and SIGHUP end the app, then ``run_app`` raises the interrupt: the
    CLI's one line, status 130 (128 + the signal for the others). The handler only notes the
    signal and asks the app to exit: raised inside the event loop (as this did for SIGINT, and
    terminate_as_interrupt's handler for the others), the interrupt landed in whichever task ran
    and "Task exception was never retrieved" with its traceback followed the one line (3 of 20
    ``kill -INT``). Left to asyncio.run, SIGINT became a cancellation that Textual took for a
    normal exit: status 0 and no word. (Ctrl+C typed in the app is a key.)"""
    import signal
    import threading

    from mlx_dgemma.errors import raising_signals

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, frame):
        app.signals.append(signum)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the loop has not started (on_mount looks) or is over (run_app looks)
            return
        loop.call_soon_threadsafe(app.exit)  # the loop may sit in select: threadsafe wakes it

    # the signals that raise (an ignored one stays ignored); not default_int_handler: asyncio.run
    # would take SIGINT over
    old = {s: signal.signal(s, end) for s in raising_signals()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_app(model: str | None = None, demo: bool = False, dtype: str | None = None,
            precision: str = "auto", think: bool = False, system: str | None = None,
            memory_limit: int | None = None, quality: str | None = None, plan: Plan | None = None) -> int:
    """Run the chat app; the exit status is non-zero if the user quits with no model loaded.
    ``think`` and ``system``: the thought channel and the system prompt to start with;
    ``memory_limit``: ``--memory-limit`` in bytes (the load's and every answer's budget);
    ``quality``: the speed/quality dial's setting to start with (``mlx_dgemma.params.QUALITIES``);
    ``plan``: the command line's memory plan of ``model`` (``mlx_dgemma.loader.plan_load``), which the load reads."""
    from mlx_dgemma.errors import ModelFilesError

    from_env = not model and not demo
    model = str(user_path(model)) if model else (configured_model() if from_env else None)
    from mlx_dgemma.request import GenerationRequest

    sampler = GenerationRequest.of(quality=quality).params  # the chat's sampler overrides to start with
    backend = ModelBackend(model=model, demo=demo, dtype=dtype, precision=precision, think=think,
                           system=system, memory_limit=memory_limit, sampler=sampler,
                           plan=plan) if (model or demo) else None
    if model and not demo and not Path(model).exists():
        source = " (from MLX_DGEMMA_MODEL)" if from_env else ""
        raise ModelFilesError(f"{model}{source}: no such file or directory; give a .gguf file or a directory "
                              "written by `mlx-dgemma convert`")
    need_terminal("chat")  # the command line asked already; a caller of run_app may not have
    app = DGemmaApp(backend)
    try:
        with _signals_end_app(app):
            app.run()
    finally:
        app.stop_engine()  # however the app ended (Ctrl+Q has waited already: not twice as long)
        stopped = app.join_engine(1.0 if app.stopping else QUIT_WAIT_S)
    from mlx_dgemma.launch import launched

    # MLX ran on the engine thread: even once that thread has ended, the interpreter's teardown
    # can abort the process ("terminate called without an active exception", status -6: 1 run
    # in 4 of `kill -TERM` to an idle app here), as it did for the server (which leaves the same
    # way). Under mlx.launch the command line's own exit tells the other ranks: left to it.
    leave = not launched() and bool(app.engines)
    if app.signals:
        from mlx_dgemma.errors import as_interrupt

        if not stopped or leave:  # inside one MLX call still, or its teardown to skip (see below)
            print("mlx-dgemma chat: interrupted; nothing partial was kept", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + app.signals[0])
        raise as_interrupt(app.signals[0])
    if app.load_error is not None:
        print(f"mlx-dgemma chat: error: {app.load_error}", file=sys.stderr)
    code = app.return_code or 0
    if not stopped:
        # The engine is still inside one MLX call (a step or a tensor of a load that takes
        # longer than QUIT_WAIT_S). Exiting the interpreter now would abort the process in
        # MLX's teardown; end it without that teardown instead (nothing is left unwritten:
        # traces are written by the UI thread, whole, before this point).
        print(f"mlx-dgemma chat: the model was still busy after {QUIT_WAIT_S:.0f} s; exiting without "
              "waiting for it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if leave:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
