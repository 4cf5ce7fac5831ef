"""The chat TUI's welcome screen and its load driven by Textual's Pilot: no model, a failed
load, quitting during the load."""

from __future__ import annotations

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.screens.chat import ChatScreen
from mlx_dgemma.tui.screens.welcome import WelcomeScreen

from .tui_fakes import GatedLoad, ScriptedBackend
from .tui_helpers import FailingLoad, SIZE, done, screen, screen_text, send, status_row, wait_for


async def test_80x24_welcome_shows_the_commands_and_buttons(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    app = DGemmaApp(None)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: "^q Quit" in screen_text(app))  # a loaded CI machine is slow
        text = screen_text(app)
        assert "mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf \\ ~/models/dgemma" in text
        for button in app.screen.query("Button"):
            assert button.region.bottom <= 24 and button.region.right <= 80, button
        assert "d Demo model" in text and "^q Quit" in text


async def test_welcome_screen_without_a_model(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    app = DGemmaApp(None)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, WelcomeScreen)
        text = app.screen.query_one("Markdown")._markdown
        assert "mlx-dgemma convert" in text
        await pilot.press("d")  # the built-in demo model
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine.loaded, timeout=60)
        assert app.backend.is_demo
        assert app.screen.query_one("#demo-banner")


async def test_failed_load_offers_the_demo_and_accepts_no_messages(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    backend = FailingLoad()
    app = DGemmaApp(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, WelcomeScreen))
        error = str(app.screen.query_one("#welcome-error").render())
        assert "not a GGUF file" in error
        assert not app.screen.query("#prompt")  # nowhere to type a message into nothing
        assert not [s for s in app.screen_stack if isinstance(s, ChatScreen)]
        await pilot.press("d")  # the demo from here works, and clears the failure
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine.loaded, timeout=60)
        assert app.backend.is_demo and app.load_error is None
        await pilot.press("ctrl+q")
    assert app.return_code == 0


async def test_quitting_after_a_failed_load_exits_non_zero():
    app = DGemmaApp(FailingLoad())
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, WelcomeScreen))
        await pilot.press("q")
    assert app.return_code not in (0, None)


async def test_a_message_sent_while_the_load_fails_goes_nowhere():
    import threading

    sent = threading.Event()

    class SlowFailingLoad(FailingLoad):
        def load(self, progress):
            sent.wait(30)  # fails only once the message has been sent
            super().load(progress)

    backend = SlowFailingLoad()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        await pilot.pause(0.1)
        await send(pilot, "hello?")  # typed while "loading: …"
        sent.set()
        await wait_for(pilot, lambda: isinstance(app.screen, WelcomeScreen))
        await pilot.pause(0.3)
        assert backend.prompts == []
        assert app.load_error is not None


async def test_escape_on_a_message_sent_during_the_load_cancels_it_before_it_starts():
    backend = GatedLoad(steps=2, blocks=1)
    app = DGemmaApp(backend)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
            await send(pilot, "hello?")  # typed while "loading: …": it waits for the model
            assert screen(app).busy
            await pilot.press("escape")
            backend.release.set()
            await wait_for(pilot, lambda: done(app))  # the screen heard the end: not "answering" forever
            assert backend.prompts == []  # it never ran (no prefill spent on it)
            await pilot.pause(0.1)
            assert status_row(app).lstrip().startswith("cancelled before it started"), status_row(app)
            await send(pilot, "again")  # the worker serves the next message
            await wait_for(pilot, lambda: done(app) and len(backend.prompts) == 1)
    finally:
        backend.release.set()


async def test_ctrl_q_during_the_load_stops_it_between_pieces():
    import time

    class PiecewiseLoad(ScriptedBackend):
        pieces = 0

        def load(self, progress):
            for i in range(1, 501):  # 10 s in all: Ctrl+Q must not wait for the rest
                progress(f"loading {i}/500 blk.{i}.weight")
                self.pieces = i
                time.sleep(0.02)
            self.loaded += 1

    backend = PiecewiseLoad()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.pieces >= 3)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)
    assert not app.engine_running() and backend.pieces < 500 and not backend.loaded
    assert app.return_code == 0 and app.load_error is None  # a stop, not a failed load


async def test_ctrl_q_during_the_load_does_not_speak_of_a_step():
    """While the model loads there is no step to finish: the status line says "stopping…"."""
    backend = GatedLoad("loading 1/2 blk.0.weight", finish=False, steps=2, blocks=1)
    app = DGemmaApp(backend)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: "loading" in status_row(app))
            quitting = app.run_worker(app.action_quit())
            await wait_for(pilot, lambda: app.stopping)
            await pilot.pause(0.1)
            assert status_row(app).strip() == "stopping…", status_row(app)
            backend.release.set()
            await quitting.wait()
    finally:
        backend.release.set()


def test_the_welcome_screen_and_the_help_say_where_to_download_the_model():
    """A new user with no model saw the file's name and size but not where to get it: the
    welcome screen and `mlx-dgemma --help` give README's download command."""
    import re
    from pathlib import Path

    from mlx_dgemma.cli import build_parser
    from mlx_dgemma.tui.screens.welcome import WELCOME

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    download = re.search(r"`(hf download [^`]+)`", readme).group(1)
    help_text = build_parser([]).format_help()
    for shown in (WELCOME, help_text):
        assert download in re.sub(r"\s*\\\n\s*", " ", shown), shown


def test_the_welcome_convert_command_writes_a_form_this_mac_runs():
    """The welcome screen's command wrote the exact form (21.36 GB), which a 24 or 32 GB Mac then
    refused to load; it asks for the most exact form that runs here (`--precision auto`)."""
    import re
    import shlex

    from mlx_dgemma.cli import build_parser
    from mlx_dgemma.tui.screens.welcome import WELCOME

    joined = re.sub(r"\s*\\\n\s*", " ", WELCOME)
    command = next(line for line in joined.splitlines() if line.startswith("mlx-dgemma convert "))
    args = build_parser(["convert"]).parse_args(shlex.split(command)[1:])
    assert args.command == "convert" and args.precision == "auto", command
    assert "mlx-dgemma chat --model ~/models/dgemma" in WELCOME and args.out_dir == "~/models/dgemma"
