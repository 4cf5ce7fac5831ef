"""The chat TUI driven by Textual's Pilot (scripted backend, and the tiny real model)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
import subprocess
import sys

import pytest

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.engine import Backend, Engine, ModelBackend
from mlx_dgemma.tui.messages import STATES, EngineStatus
from mlx_dgemma.tui.screens.chat import ChatScreen
from mlx_dgemma.tui.screens.settings import SettingsScreen
from mlx_dgemma.tui.screens.welcome import WelcomeScreen
from mlx_dgemma.tui.widgets.canvas import CanvasView
from mlx_dgemma.tui.widgets.chat_log import Answer

from .tui_fakes import GatedLoad, ScriptedBackend

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
        view.show = lambda ev, earlier: (drawn.append((ev.block, ev.step)), real_show(ev, earlier))
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
        assert "finished: end of turn" in str(s.query_one("#status").render())


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
        assert s.cursor == (0, 3) and view.event.block == 1  # crossed into the previous block (blocks count from 1)
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
    assert len(lines) == 1 + 6
    header, *recs = [json.loads(x) for x in lines]
    import mlx_dgemma

    # the header says what produced the steps: the message, the settings in effect, the model
    assert header["record"] == "header" and header["prompt"] == "q" and header["turn"] == 1
    assert header["model"] == backend.label and header["precision"] == backend.precision_label
    assert header["mlx_dgemma_version"] == mlx_dgemma.__version__ and header["seed"] is None
    assert header["settings"]["max_denoising_steps"] == 48 and header["settings"]["t_min"] == 0.4
    assert header["thinking"] is False and header["system"] is None
    assert [(r["block"], r["step"]) for r in recs] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    assert all(len(r["canvas"]) == len(r["entropy"]) == len(r["accepted"]) == 16 for r in recs)
    assert recs[-1]["stopped"] and recs[0]["draft_text"].startswith("The sky")


@asynccontextmanager
async def settings_open() -> AsyncIterator[tuple[DGemmaApp, Any, ScriptedBackend]]:
    """The app on a loaded scripted model with the settings dialog (Ctrl+O) open."""
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, SettingsScreen)
        yield app, pilot, backend


async def test_settings_validate_and_apply():
    async with settings_open() as (app, pilot, backend):
        box = app.screen.query_one("#set-t_min")
        box.value = "0.9"  # above t_max: refused with the rule
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        error = str(app.screen.query_one("#settings-error").render())
        assert "temperature floor (0.9) must be below the first-step temperature (0.8)" in error
        assert "t_min" not in error and "t_max" not in error  # the labels shown, not internal names
        assert "the temperature falls from the first step to the last" in screen_text(app)  # not clipped
        box.value = "0.3"
        app.screen.query_one("#set-max_denoising_steps").value = "7"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        s = screen(app)
        assert s.params["max_denoising_steps"] == 7 and s.params["t_min"] == 0.3
        await send(pilot, "x")
        await wait_for(pilot, lambda: done(app))
        assert backend.prompts[0][1]["max_denoising_steps"] == 7


async def test_settings_enter_in_a_field_saves():
    async with settings_open() as (app, pilot, backend):
        box = app.screen.query_one("#set-max_denoising_steps")
        box.value = "0"  # refused: Enter shows the error and keeps the dialog
        box.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        assert "max steps per block: 0 must be" in str(app.screen.query_one("#settings-error").render())
        box.value = "7"
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert screen(app).params["max_denoising_steps"] == 7


@pytest.mark.parametrize("field, value, expected", [
    ("t_max", "5000", "first-step temperature: 5000 must be a temperature in [0.001, 1000]"),
    ("t_max", "-1", "first-step temperature: -1 must be a temperature in [0.001, 1000]"),
    ("t_min", "5000", "temperature floor: 5000 must be a temperature in [0.001, 1000]"),
    ("max_denoising_steps", "0", "max steps per block: 0 must be an integer in [1, 10000]"),
])
async def test_settings_name_a_fields_range_before_the_rules_between_fields(field, value, expected):
    async with settings_open() as (app, pilot, backend):
        app.screen.query_one(f"#set-{field}").value = value
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        error = str(app.screen.query_one("#settings-error").render())
        assert error == expected
        assert "above" not in error and "below" not in error


async def test_settings_cleared_field_means_the_models_default():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        screen(app).params = {"entropy_bound": 0.3, "seed": 5}
        notes = []
        app.notify = lambda message, **kw: notes.append(message)
        await pilot.press("ctrl+o")
        box = app.screen.query_one("#set-entropy_bound")
        assert box.value == "0.3" and box.placeholder == "default 0.1"
        box.value = ""  # cleared: back to the model's default, and the app says so
        app.screen.query_one("#set-seed").value = ""
        app.screen.query_one("#set-max_denoising_steps").value = "7"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert screen(app).params == {"max_denoising_steps": 7}
        assert any("max steps per block 7" in n and "the rest are the model's defaults" in n for n in notes)


async def test_new_chat_resets():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        assert "block 1" in str(screen(app).query_one("#canvas-title").render())
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: backend.resets == 1)
        assert not screen(app).query(Answer) and screen(app).trace.blocks == []
        assert str(screen(app).query_one("#canvas-title").render()) == "canvas"  # no stale "block 1, step 2/48"


async def test_a_new_chat_in_replay_leaves_nothing_of_the_last_answer():
    backend = ScriptedBackend(steps=2, blocks=2)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+b")  # replaying the last answer
        s = screen(app)
        assert s.cursor is not None and s._prefill_tps
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: backend.resets == 1)
        assert s.cursor is None and s._last_done is None and s._prefill_tps is None and s._step_seconds == []
        assert s.query_one(CanvasView).event is None and s.query_one("#chart").entropy == []
        assert status_row(app).strip() == "new chat" and s.turn == 0
        await send(pilot, "again")  # the next answer is live from its first step
        await wait_for(pilot, lambda: done(app))
        assert s.cursor is None and len(s.trace.steps) == 4 and s.trace.header["turn"] == 1


async def test_chart_and_status_number_steps_alike():
    backend = ScriptedBackend(steps=4, blocks=2)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+b")  # replay: the status line shows the step, as does the chart
        status = str(screen(app).query_one("#status").render())
        chart = str(screen(app).query_one("#chart").render())
        assert "step 3/48" in status and "step 3/48" in chart


def screen_text(app) -> str:
    """What the terminal shows, as text, with whitespace runs collapsed (wrapped lines join)."""
    lines = [strip.text for strip in app.screen._compositor.render_strips()]
    text = " ".join(lines).translate({ord(c): " " for c in "█▊▎│▔▁▄▀"})  # borders, not text
    return " ".join(text.split())


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


async def test_80x24_chat_footer_shows_every_binding():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await wait_for(pilot, lambda: "esc" in screen_text(app))
        footer = [strip.text for strip in app.screen._compositor.render_strips()][-1]
        for key in ("esc", "^n", "^o", "^b", "^f", "^t", "^q Quit"):
            assert key in footer, footer


def failing_backend(error: Exception) -> ScriptedBackend:
    """A scripted backend whose every answer raises ``error`` (the UI must show it, not crash)."""

    class Failing(ScriptedBackend):
        def stream(self, prompt, cancel, **params):
            raise error
            yield  # pragma: no cover

    return Failing()


async def test_errors_are_shown_not_raised():
    app = DGemmaApp(failing_backend(RuntimeError("the GPU caught fire")))
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
    code = ("import sys, mlx_dgemma, mlx_dgemma.loader, mlx_dgemma.model, mlx_dgemma.generation, mlx_dgemma.trace, "
            "mlx_dgemma.cli, mlx_dgemma.server, mlx_dgemma.convert.converter, mlx_dgemma.convert.verify; "
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


async def test_chat_log_follows_the_answer_after_a_resize():
    backend = ScriptedBackend(steps=3, blocks=8, delay=0.05)
    app = DGemmaApp(backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "long answer please")
        await wait_for(pilot, lambda: len(screen(app).trace.blocks) >= 2)
        await pilot.resize_terminal(80, 24)  # mid-answer
        await wait_for(pilot, lambda: done(app))
        answer = screen(app).query_one(Answer)
        await wait_for(pilot, lambda: answer.rendered == answer.target)
        await pilot.pause(0.2)
        log = screen(app).query_one("#chat-log")
        assert log.max_scroll_y > 0  # the answer is taller than the log
        assert log.scroll_y == log.max_scroll_y  # and the log shows its end


# --------------------------------------------------------------------------- the backend seam


def protocol_problems(backend) -> list[str]:
    """How ``backend`` differs from the Backend protocol: missing members, attributes of the
    wrong type, methods whose parameters differ (names and kinds, as the engine calls them)."""
    import inspect
    import types
    import typing

    problems = [] if isinstance(backend, Backend) else ["not a Backend (runtime check)"]
    for name, kind in typing.get_type_hints(Backend).items():
        value = getattr(backend, name, problems)
        origin = typing.get_origin(kind)
        allowed = typing.get_args(kind) if origin in (typing.Union, types.UnionType) else (origin or kind)
        if value is problems:
            problems.append(f"{name}: missing")
        elif not isinstance(value, allowed):
            problems.append(f"{name}: {type(value).__name__}, expected {kind}")
    for name, member in vars(Backend).items():
        if name.startswith("_") or not callable(member):
            continue
        if not callable(getattr(backend, name, None)):
            problems.append(f"{name}(): missing")
            continue
        want = [(p.name, p.kind) for p in inspect.signature(member).parameters.values()][1:]
        have = [(p.name, p.kind) for p in inspect.signature(getattr(backend, name)).parameters.values()]
        if have != want:
            problems.append(f"{name}{inspect.signature(getattr(backend, name))}: expected {inspect.signature(member)}")
    return problems


def test_the_model_backend_and_the_scripted_one_satisfy_the_backend_protocol(tiny_model_dir):
    assert protocol_problems(ScriptedBackend()) == []
    assert protocol_problems(ModelBackend(demo=True)) == []
    loaded = ModelBackend(model=str(tiny_model_dir))
    loaded.load(lambda line: None)
    assert protocol_problems(loaded) == []

    class Drifted(ScriptedBackend):  # the check itself: a backend that drifted from the protocol
        is_demo = "no"

        def piece(self, token: int) -> str:
            return ""

    problems = protocol_problems(Drifted())
    assert [p.split(":")[0].split("(")[0] for p in problems] == ["is_demo", "piece"], problems


# --------------------------------------------------------------------------- every status shows


def status_text(app) -> str:
    return str(screen(app).query_one("#status").render())


def placeholder(app) -> str:
    return screen(app).query_one("#prompt").placeholder


# What each engine state shows; a state the chat screen dropped would time out here.
STATUS_SHOWN = {
    "loading": lambda app: status_text(app) == "loading: DETAIL" and placeholder(app).startswith("Loading the model"),
    "ready": lambda app: (status_text(app) == "ready: DETAIL" and not screen(app).busy
                          and placeholder(app) == "Message (Enter to send)"),
    "busy": lambda app: (screen(app).busy and status_text(app).startswith("answering")
                         and placeholder(app).startswith("Answering")),
    "failed": lambda app: (isinstance(app.screen, WelcomeScreen) and app.load_error == "DETAIL"
                           and "DETAIL" in str(app.screen.query_one("#welcome-error").render())),
}


def test_every_engine_state_has_a_visible_check():
    assert sorted(STATUS_SHOWN) == sorted(STATES)
    with pytest.raises(ValueError, match="'done'"):
        EngineStatus("done")  # a state no screen handles cannot be posted


def test_the_engine_posts_every_state_and_only_those():
    posted: list[str] = []
    record = lambda m: posted.append(m.state) if isinstance(m, EngineStatus) else None  # noqa: E731
    engine = Engine(ScriptedBackend(steps=1, blocks=1), record)
    engine.start()
    engine.generate("q", {}, 1)
    assert engine.worker.submit(lambda t: None).done.wait(10)  # after the answer, in order
    engine.stop()
    assert engine.join(10)
    engine = Engine(FailingLoad(), record)
    engine.start()
    assert engine.join(10)  # a failed load ends the worker
    assert posted == ["loading", "loading", "ready", "busy", "ready", "loading", "failed"]
    assert set(posted) == set(STATES)


@pytest.mark.parametrize("state", STATES)
async def test_each_engine_state_is_shown(state):
    backend = ScriptedBackend()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.loaded and status_text(app).startswith("ready"))
        s = screen(app)
        s.busy = state == "ready"  # the opposite of what the state should leave
        s.query_one("#status").update("before")
        s.query_one("#prompt").placeholder = "before"
        s.post_message(EngineStatus(state, "DETAIL"))
        await wait_for(pilot, lambda: STATUS_SHOWN[state](app))


# --------------------------------------------------------------------------- errors by class


class BudgetTooSmall(Exception):
    """Not one of ours: shown with its type name."""


@pytest.mark.parametrize("error, shown", [
    ("MemoryBudgetError", "error: prompt: 9 tokens need about 2 GB more memory"),  # a DGemmaError subclass
    ("BudgetTooSmall", "error: BudgetTooSmall: prompt: 9 tokens need about 2 GB more memory"),
])
async def test_errors_are_told_apart_by_class_not_by_message(error, shown):
    from mlx_dgemma.errors import MemoryBudgetError

    cls = {"MemoryBudgetError": MemoryBudgetError, "BudgetTooSmall": BudgetTooSmall}[error]

    app = DGemmaApp(failing_backend(cls("prompt: 9 tokens need about 2 GB more memory")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.loaded)
        await send(pilot, "q")
        await wait_for(pilot, lambda: bool(screen(app).query(".error")))
        assert str(screen(app).query_one(".error").render()) == shown
        assert status_text(app) == shown  # the status line says it too, brackets and all


# --------------------------------------------------------------------------- the status line fits


def status_row(app) -> str:
    """The status line as the terminal shows it."""
    row = screen(app).query_one("#status").region.y
    return app.screen._compositor.render_strips()[row].text


@pytest.mark.parametrize("width", [80, 100])
async def test_the_status_line_fits_80_and_100_columns(width):
    backend = ScriptedBackend(steps=4, blocks=2)
    app = DGemmaApp(backend)
    async with app.run_test(size=(width, 24)) as pilot:
        await ask(pilot, backend)
        await pilot.pause(0.1)
        done = status_row(app)
        for part in ("finished: end of turn", "8 steps", "0.25 s/step", "peak 0.20 GB", "fast (bfloat16)"):
            assert part in done, done
        await pilot.press("ctrl+b")
        await pilot.pause(0.1)
        step = status_row(app)
        for part in ("block 2/2", "step 3/48", "0.25 s/step", "mem 0.12 GB", "fast (bfloat16)", "replay ^b/^f"):
            assert part in step, step
        assert step.rstrip().endswith("replay ^b/^f")  # nothing cut at the edge
    if width == 100:
        assert "ctrl+b/f replay" in done and "T=0." in step  # room for more at 100 columns


def test_status_parts_are_left_out_whole_least_important_first():
    from mlx_dgemma.tui.widgets.status import fit

    parts = [("a", 0), ("bb", 2), ("cc", 1), ("dd", 2), ("e", 0)]
    assert fit(parts, 20) == "a  bb  cc  dd  e"
    assert fit(parts, 12) == "a  bb  cc  e"  # the rightmost of the highest rank goes first
    assert fit(parts, 9) == "a  cc  e"
    assert fit(parts, 1) == "a  e"  # rank 0 stays, even when too wide


def screen_lines(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 30)])
async def test_the_canvas_key_and_the_demo_banner_fit(size):
    backend = ScriptedBackend(steps=4, blocks=2)
    backend.is_demo = True
    app = DGemmaApp(backend)
    async with app.run_test(size=size) as pilot:
        await ask(pilot, backend)
        for replay in (False, True):
            if replay:
                await pilot.press("ctrl+b")
            await pilot.pause()
            title = screen(app).query_one("#canvas-title")
            heading, key = [title.region.y + i for i in (0, 1)]
            lines = screen_lines(app)
            assert ("(replay)" in lines[heading]) == replay
            # every part of the key, whole, inside the panel (the old one-line title lost them at 120)
            shown = lines[key][title.region.x:title.region.right]
            parts = ["now", "before", "draft", "entropy" if size[0] > 80 else "bg"]
            assert all(p in shown for p in parts), shown
        banner = screen(app).query_one("#demo-banner")
        assert banner.region.height == 1  # one row, not 3-5 in the chat pane
        top = lines[banner.region.y]
        assert "DEMO" in top and "not DiffusionGemma's weights" in top and "…" not in top


def test_the_canvas_key_is_the_longest_wording_that_fits():
    from mlx_dgemma.tui.widgets.canvas import legend, legend_wordings

    wordings = [t.plain for t in legend_wordings()]
    for width in range(20, 90):
        shown = legend(width).plain
        assert len(shown) <= width or shown == wordings[-1]
        longer = [w for w in wordings if len(w) > len(shown)]
        assert all(len(w) > width for w in longer)  # no longer wording would fit


def test_the_canvas_key_reads_as_a_key_not_as_column_headers():
    # Bare words ("accepted now  accepted before  draft") above a three-column grid were read as
    # the columns' names: the key says it is one, and each entry carries its colour's swatch.
    from mlx_dgemma.tui.widgets.canvas import DRAFT, NOW, legend

    key = legend(80)
    assert key.plain.startswith("key: ")
    for word, style in (("accepted now", NOW), ("draft", DRAFT)):
        at = key.plain.index("■ " + word)
        assert any(s.start <= at < s.end and s.style == style for s in key.spans), (word, key.spans)


async def test_canvas_cells_show_whole_words_where_there_is_room():
    backend = ScriptedBackend(steps=2, blocks=1)  # 16 positions: room for wide cells
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        text = str(screen(app).query_one(CanvasView).render())
        assert "scatters" in text and "…" not in text


def test_canvas_cells_narrow_to_fit_every_position():
    from mlx_dgemma.tui.widgets.canvas import CELL, MAX_CELL, cell_width

    assert cell_width(68, 18, 64) == MAX_CELL  # 4 columns (of 17, capped) hold 64 positions in 18 rows
    assert cell_width(45, 13, 64) == 9  # 5 columns: 13 rows hold 65 cells
    assert cell_width(45, 4, 256) == CELL  # never narrower than the minimum (the panel scrolls/clips)
    for w, h, n in [(68, 18, 64), (45, 13, 64), (120, 30, 256)]:
        c = cell_width(w, h, n)
        assert CELL <= c <= MAX_CELL
        if c > CELL:
            assert (w // c) * h >= n  # wider cells only when every position still fits


async def test_a_cancelled_answer_says_where_it_stopped_and_shows_no_undefined_figures():
    backend = ScriptedBackend(steps=200, blocks=1, delay=0.02)
    app = DGemmaApp(backend)
    async with app.run_test(size=(140, 30)) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "long")
        await wait_for(pilot, lambda: len(screen(app).trace.steps) >= 3)
        await pilot.press("escape")
        await wait_for(pilot, lambda: done(app))
        await pilot.pause(0.1)
        s = screen(app)
        reached = s.trace.blocks[-1][-1].step
        line = status_row(app)
        assert f"cancelled at block 1, step {reached}" in line, line
        # the answer committed no block: no tokens per forward, never "0.00 tok/fwd"
        assert "tok/fwd" not in line and "0.00 s/step" not in line, line
        assert f"{reached} steps" in line
        await pilot.press("ctrl+b")
        await pilot.pause(0.1)
        replay = status_row(app)
        assert "replay" in replay and "tok/fwd" not in replay and "0.00 s/step" not in replay, replay


def test_the_summary_of_a_cancelled_prefill_names_no_steps():
    from mlx_dgemma.events import DoneEvent
    from mlx_dgemma.tui.widgets.status import summary_parts

    done = DoneEvent(text="", thinking="", tokens=(), finish_reason="cancelled", prompt_tokens=900,
                     prefill_seconds=1.5, prefill_tokens_per_second=0.0, steps=0, steps_per_block=(),
                     seconds_per_step=0.0, tokens_per_forward=0.0, generation_seconds=0.0,
                     peak_memory_bytes=100_000_000, precision="exact (float32)")
    text = " | ".join(t for t, _ in summary_parts(done, None))
    assert text.startswith("cancelled during the prefill")
    for undefined in ("step", "s/step", "tok/fwd", "prefill 0", "replay"):
        assert undefined not in text.replace("the prefill", ""), text
    one = DoneEvent(text="a", thinking="", tokens=(1,), finish_reason="length", prompt_tokens=9, prefill_seconds=0.1,
                    prefill_tokens_per_second=90.0, steps=1, steps_per_block=(1,), seconds_per_step=0.5,
                    tokens_per_forward=1.0, generation_seconds=0.6, peak_memory_bytes=1, precision="")
    text = " | ".join(t for t, _ in summary_parts(one))
    assert text.startswith("stopped: max new tokens reached | 1 block | 1 step |"), text


async def test_toasts_are_short_and_leave_the_status_line_visible():
    Toast = "Toast"  # by type name: the class lives in textual's private ``widgets._toast``

    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await ask(pilot, backend)
        before = status_row(app)
        app.notify("Cancelling at the next step…")
        await wait_for(pilot, lambda: app.screen.query(Toast))
        await pilot.pause(0.1)
        toast = app.screen.query_one(Toast)
        status = screen(app).query_one("#status").region
        assert toast.region.bottom <= status.y and toast.region.height == 1, (toast.region, status)
        assert status_row(app) == before  # the summary is still readable under a toast
        assert app.NOTIFICATION_TIMEOUT <= 3


async def test_thought_channel_and_system_prompt_from_the_command_line_and_the_settings():
    from textual.widgets import Checkbox, Input

    backend = ScriptedBackend(steps=2, blocks=1, think=True, system="Answer in the style of the KJV.")
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        assert backend.thinks == [True]  # --think reaches the answer
        modes = lambda: screen(app).query_one("#prompt", Input).border_title  # noqa: E731
        assert modes() == "thinking on · system prompt set"  # shown while one chats, not only in Ctrl+O
        await pilot.press("ctrl+o")
        assert app.screen.query_one("#set-think", Checkbox).value is True
        assert app.screen.query_one("#set-system", Input).value == "Answer in the style of the KJV."
        app.screen.query_one("#set-think", Checkbox).value = False
        app.screen.query_one("#set-system", Input).value = "Be brief."
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        # a new system prompt opens a new conversation (it comes first in the cache)
        await wait_for(pilot, lambda: backend.systems == ["Be brief."])
        await wait_for(pilot, lambda: not screen(app).query(Answer))
        await ask(pilot, backend)
        assert backend.thinks == [True, False]
        assert modes() == "system prompt set"
        await pilot.press("ctrl+o")  # thinking on again, same system prompt: the chat goes on
        app.screen.query_one("#set-think", Checkbox).value = True
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        await ask(pilot, backend)
        assert backend.thinks == [True, False, True] and backend.systems == ["Be brief."]
        await pilot.press("ctrl+n")  # a new chat keeps the chosen system prompt
        await wait_for(pilot, lambda: backend.systems == ["Be brief.", "Be brief."])


def test_the_model_backend_passes_thinking_and_the_system_prompt_to_the_session(tiny_model_dir):
    backend = ModelBackend(model=str(tiny_model_dir), think=True, system="S1")
    backend.load(lambda line: None)
    assert backend.session.enable_thinking is True
    assert backend.session.messages == [{"role": "system", "content": "S1"}]
    events = list(backend.stream("hi", lambda: False, think=False, max_new_tokens=1, max_denoising_steps=1, seed=0))
    assert backend.session.enable_thinking is False and events
    assert [m["role"] for m in backend.session.messages] == ["system", "user", "assistant"]
    backend.reset("S2")
    assert backend.session.messages == [{"role": "system", "content": "S2"}] and not backend.session.history
    backend.reset(None)
    assert backend.session.messages == []


def test_chat_command_takes_think_and_system(monkeypatch):
    from mlx_dgemma import cli
    from mlx_dgemma.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module, "run_app", lambda **kw: seen.update(kw) or 0)
    monkeypatch.setattr("mlx_dgemma.launch.need_terminal", lambda command="chat": None)  # as in a terminal
    assert cli.main(["chat", "--demo", "--think", "--system", "Be brief."]) == 0
    assert seen["think"] is True and seen["system"] == "Be brief."
    assert cli.main(["chat", "--demo"]) == 0
    assert seen["think"] is False and seen["system"] is None
    seen.clear()
    assert cli.main(["chat", "--demo", "--system", "a\udcff"]) == 2  # undecodable argv bytes: refused first
    assert seen == {}


def test_the_screenshot_script_writes_the_tracked_picture_only_when_asked(tmp_path, monkeypatch):
    from pathlib import Path

    from tests.scripts import ROOT, load_script

    mod = load_script("scripts/screenshot.py")
    docs = ROOT / "docs" / "screenshot.svg"
    monkeypatch.chdir(tmp_path)
    assert mod.output_path(None, False) == Path("screenshot.svg")  # untracked, in the current directory
    assert mod.output_path(str(tmp_path / "x.svg"), False) == tmp_path / "x.svg"
    assert mod.output_path(None, True) == docs.resolve()
    with pytest.raises(SystemExit, match="--update-docs"):
        mod.output_path(str(docs), False)
    shots = []

    async def shoot(path, *args):  # the app itself is not run here
        shots.append(path)

    monkeypatch.setattr(mod, "shoot", shoot)
    assert mod.main([]) == 0 and shots == ["screenshot.svg"]
    with pytest.raises(SystemExit):
        mod.main([str(docs)])
    assert shots == ["screenshot.svg"]


async def test_the_trace_header_carries_the_chosen_settings_and_the_turn(tmp_path):
    backend = ScriptedBackend(steps=2, blocks=1, think=True, system="Be brief.")
    app = DGemmaApp(backend, trace_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend, "first")
        screen(app).params = {"seed": 7, "t_max": 0.9}
        await send(pilot, "second")
        await wait_for(pilot, lambda: len(backend.prompts) == 2 and done(app))
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.last_export is not None)
    header = json.loads(app.last_export.read_text().splitlines()[0])
    assert header["prompt"] == "second" and header["turn"] == 2
    assert header["seed"] == 7 and header["settings"]["t_max"] == 0.9 and "seed" not in header["settings"]
    assert header["thinking"] is True and header["system"] == "Be brief."


async def test_quit_during_an_answer_says_stopping_and_waits_for_the_engine():
    backend = ScriptedBackend(steps=200, blocks=1, delay=0.4)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "long")
        await wait_for(pilot, lambda: len(screen(app).trace.steps) >= 1)
        chat = screen(app)
        quitting = app.run_worker(app.action_quit())  # Ctrl+Q, watched while it waits
        await wait_for(pilot, lambda: app.stopping)
        await pilot.pause(0.1)
        assert status_row(app).strip().startswith("stopping…")
        await quitting.wait()
    assert not app.engine_running()  # joined before the app exits: no thread left inside MLX
    assert backend.produced < 200 and app.return_code == 0
    assert chat.trace.steps  # what was drawn stays; nothing after the quit was


async def test_ctrl_q_quits_from_the_settings_dialog():
    """A modal screen must not swallow Ctrl+Q (the footer still offers it there)."""
    async with settings_open() as (app, pilot, backend):
        assert app.screen.query_one("#set-accept_probability").placeholder == "off: EntropyBound"  # not "random"
        await pilot.press("ctrl+q")
        await pilot.pause()
    assert app.return_code == 0


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


def test_the_last_step_of_a_block_shows_the_committed_tokens():
    """A block commits its stopping step's argmax (the draft), not that step's sampled canvas;
    the canvas's last frame must show the answer the chat log then prints (the demo showed
    "the" in a cell whose committed word was "grace")."""
    import numpy as np

    from mlx_dgemma.events import StepEvent

    words = ["the", "grace", "sky", "blue"]
    view = CanvasView(piece=lambda i: words[i])

    def frame(step: int, stopped: bool) -> list[str]:
        ev = StepEvent(block=1, step=step, max_steps=8, canvas=np.array([2, 0, 3], np.int32),
                       draft=np.array([2, 1, 3], np.int32), accepted=np.ones(3, bool),
                       entropy=np.zeros(3, np.float32), mean_entropy=0.0, temperature=0.1, seconds=0.1,
                       stopped=stopped)
        view.show(ev, np.zeros(3, bool))
        return view.render().plain.split()

    assert frame(3, stopped=False) == ["sky", "the", "blue"]  # mid-block: the sampled canvas
    assert frame(5, stopped=True) == ["sky", "grace", "blue"]  # the stopping rule fired: committed
    assert frame(8, stopped=False) == ["sky", "grace", "blue"]  # the step cap: committed too


def test_chat_without_a_terminal_is_refused_in_one_line():
    """Textual reads keys from stdin and draws on stderr: with stdin not a terminal (a script,
    cron, `< /dev/null`) the app used to start anyway, draw escape codes and wait forever."""
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "chat", "--demo"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, (r.returncode, r.stderr[-500:])
    assert err[0].startswith("mlx-dgemma chat: error: ") and "terminal" in err[0] and "generate" in err[0]
    assert "\x1b[" not in r.stdout + r.stderr  # nothing drawn


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


async def test_the_prompt_placeholders_fit_an_80_column_terminal():
    """At 80x24 the placeholder during an answer read "Answering… (Escape to": the key that
    cancels was cut off."""
    from rich.cells import cell_len

    backend = ScriptedBackend(steps=200, blocks=1, delay=0.02)
    app = DGemmaApp(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        prompt = screen(app).query_one("#prompt")
        shown = [prompt.placeholder]
        await send(pilot, "long")
        await wait_for(pilot, lambda: screen(app).busy)
        await pilot.pause()
        shown.append(prompt.placeholder)
        assert len(set(shown)) == 2  # ready, then busy
        for text in shown:
            assert cell_len(text) <= prompt.content_size.width, (text, prompt.content_size.width)
        await pilot.press("escape")
        await wait_for(pilot, lambda: done(app))


async def test_a_refused_message_goes_back_to_the_prompt():
    """A message the model refuses (too long for the context: "shorten the prompt") was lost:
    the prompt had been cleared, so the user had to paste it again to shorten it."""
    from mlx_dgemma.errors import ParameterError

    class Refusing(ScriptedBackend):
        def stream(self, prompt, cancel, think=False, **params):
            self.prompts.append((prompt, params))
            raise ParameterError("prompt: 10016 tokens plus 4 block(s) of 64 exceed the context of 4096; "
                                 "shorten the prompt")
            yield  # a generator, as the real one

    backend = Refusing()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "a long message")
        await wait_for(pilot, lambda: backend.prompts and not screen(app).busy
                       and "shorten the prompt" in str(screen(app).query_one("#status").render()))
        await pilot.pause()
        assert screen(app).query_one("#prompt").value == "a long message"
