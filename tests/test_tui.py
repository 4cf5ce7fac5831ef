"""The chat TUI driven by Textual's Pilot (scripted backend, and the tiny real model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.engine import ModelBackend
from mlx_dgemma.tui.screens.chat import ChatScreen
from mlx_dgemma.tui.screens.settings import SettingsScreen
from mlx_dgemma.tui.screens.welcome import WelcomeScreen
from mlx_dgemma.tui.widgets.canvas import CanvasView
from mlx_dgemma.tui.widgets.chat_log import Answer

from .tui_fakes import ScriptedBackend

SIZE = (140, 40)


async def wait_for(pilot, cond, timeout=20.0):
    waited = 0.0
    while not cond():
        await pilot.pause(0.05)
        waited += 0.05
        if waited > timeout:
            raise AssertionError("timed out waiting for the app")


async def send(pilot, text):
    await pilot.click("#prompt")
    for ch in text:
        await pilot.press(ch if ch != " " else "space")
    await pilot.press("enter")


def screen(app) -> ChatScreen:
    assert isinstance(app.screen, ChatScreen)
    return app.screen


def done(app):
    s = app.screen
    return isinstance(s, ChatScreen) and s._last_done is not None and not s.busy


async def ask(pilot, backend, text="q"):
    """Wait for the model, send ``text`` and wait until the answer is done."""
    await wait_for(pilot, lambda: backend.loaded)
    await send(pilot, text)
    await wait_for(pilot, lambda: done(pilot.app))


async def test_prompt_fills_canvas_step_by_step_and_answers():
    backend = ScriptedBackend(steps=6, blocks=2, delay=0.1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        view = screen(app).query_one(CanvasView)
        drawn = []
        real_show = view.show
        view.show = lambda ev, earlier, caption="": (drawn.append((ev.block, ev.step)), real_show(ev, earlier))
        await send(pilot, "Why blue?")
        await wait_for(pilot, lambda: done(app))
        s = screen(app)
        assert backend.prompts[0][0] == "Why blue?"
        assert len(set(drawn)) >= 6  # the panel followed the steps, not only the last one
        assert drawn == sorted(drawn)  # in order
        assert [len(b) for b in s.trace.blocks] == [6, 6]
        assert s.query_one(CanvasView).event.step == 6
        answer = s.query_one(Answer)
        await wait_for(pilot, lambda: answer.rendered == answer.target)
        assert answer.rendered.startswith("The sky is blue because")
        assert answer._collapsible.display  # thought channel present, collapsed
        assert answer._collapsible.collapsed
        assert "eos" in str(s.query_one("#status").render())


async def test_cancel_stops_the_worker():
    backend = ScriptedBackend(steps=200, blocks=1, delay=0.02)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "long")
        await wait_for(pilot, lambda: len(screen(app).trace.steps) >= 3)
        at_cancel = {}
        real_cancel = app.engine.cancel
        app.engine.cancel = lambda: (at_cancel.setdefault("n", backend.produced), real_cancel())
        await pilot.press("escape")
        await wait_for(pilot, lambda: done(app))
        s = screen(app)
        assert s._last_done.finish_reason == "cancelled"
        assert backend.produced <= at_cancel["n"] + 1  # stopped at the next step
        assert backend.produced < 200
        # the engine thread still serves the next request
        await send(pilot, "again")
        await wait_for(pilot, lambda: len(backend.prompts) == 2)


async def test_replay_moves_through_steps():
    backend = ScriptedBackend(steps=4, blocks=2)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        s = screen(app)
        view = s.query_one(CanvasView)
        await pilot.press("ctrl+b")
        assert s.cursor == (1, 2) and view.event.step == 3
        for _ in range(3):
            await pilot.press("ctrl+b")
        assert s.cursor == (0, 3) and view.event.block == 0  # crossed into the previous block
        await pilot.press("ctrl+f")
        assert s.cursor == (1, 0) and view.event.step == 1
        assert "replay" in str(s.query_one("#canvas-title").render())


async def test_export_writes_json_lines(tmp_path):
    backend = ScriptedBackend(steps=3, blocks=2)
    app = DGemmaApp(backend, trace_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.last_export is not None)
    lines = app.last_export.read_text().splitlines()
    assert len(lines) == 6
    recs = [json.loads(x) for x in lines]
    assert [(r["block"], r["step"]) for r in recs] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    assert all(len(r["canvas"]) == len(r["entropy"]) == len(r["accepted"]) == 16 for r in recs)
    assert recs[-1]["stopped"] and recs[0]["draft_text"].startswith("The sky")


async def test_settings_validate_and_apply():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, SettingsScreen)
        box = app.screen.query_one("#set-t_min")
        box.value = "0.9"  # above t_max: refused with the rule
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        assert "t_min" in str(app.screen.query_one("#settings-error").render())
        box.value = "0.3"
        app.screen.query_one("#set-max_denoising_steps").value = "7"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        s = screen(app)
        assert s.params["max_denoising_steps"] == 7 and s.params["t_min"] == 0.3
        await send(pilot, "x")
        await wait_for(pilot, lambda: done(app))
        assert backend.prompts[0][1]["max_denoising_steps"] == 7


async def test_new_chat_resets():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: backend.resets == 1)
        assert not screen(app).query(Answer) and screen(app).trace.blocks == []


async def test_errors_are_shown_not_raised():
    class Failing(ScriptedBackend):
        def stream(self, prompt, cancel, **params):
            raise RuntimeError("the GPU caught fire")
            yield  # pragma: no cover

    app = DGemmaApp(Failing())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend.loaded)
        await send(pilot, "q")
        await wait_for(pilot, lambda: bool(screen(app).query(".error")))
        assert "the GPU caught fire" in str(screen(app).query_one(".error").render())
        assert not screen(app).busy


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


async def test_real_tiny_model_in_the_app(tiny_model_dir):
    backend = ModelBackend(model=str(tiny_model_dir))
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.loaded, timeout=60)
        screen(app).params = {"max_denoising_steps": 4, "max_new_tokens": 32, "seed": 0}
        await send(pilot, "Hi")
        await wait_for(pilot, lambda: done(app), timeout=60)
        s = screen(app)
        assert s.trace.steps and s._last_done.steps == len(s.trace.steps)
        assert s.query_one(CanvasView).event.canvas.size == 32


def test_core_never_imports_textual():
    code = ("import sys, mlx_dgemma, mlx_dgemma.api, mlx_dgemma.model, mlx_dgemma.generation, mlx_dgemma.trace, "
            "mlx_dgemma.cli, mlx_dgemma.commands, mlx_dgemma.convert.converter, mlx_dgemma.convert.verify; "
            "from mlx_dgemma import load, generate, stream_generate; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'textual'], 'textual imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


class FailingLoad(ScriptedBackend):
    label = "/models/not-a-gguf"

    def load(self, progress):
        from mlx_dgemma.errors import ModelFilesError

        raise ModelFilesError("/models/not-a-gguf: not a GGUF file")


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
