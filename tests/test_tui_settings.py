"""The chat TUI's settings dialog driven by Textual's Pilot: the registry's rules in the
labels shown, the thought channel and the system prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.screens.chat import ChatScreen
from mlx_dgemma.tui.screens.settings import SettingsScreen
from mlx_dgemma.tui.widgets.chat_log import Answer

from .tui_fakes import ScriptedBackend
from .tui_helpers import SIZE, ask, done, screen, screen_text, send, wait_for


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
        assert "temperature floor: 0.9 must be below the first-step temperature (0.8)" in error
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


async def test_ctrl_q_quits_from_the_settings_dialog():
    """A modal screen must not swallow Ctrl+Q (the footer still offers it there)."""
    async with settings_open() as (app, pilot, backend):
        assert app.screen.query_one("#set-accept_probability").placeholder == "off: EntropyBound"  # not "random"
        await pilot.press("ctrl+q")
        await pilot.pause()
    assert app.return_code == 0


async def test_settings_show_every_fields_error_at_once():
    # before: the first error only; a user with three mistakes saved three times to see them
    async with settings_open() as (app, pilot, backend):
        app.screen.query_one("#set-t_max").value = "5000"
        app.screen.query_one("#set-max_denoising_steps").value = "many"
        app.screen.query_one("#set-entropy_bound").value = "-1"
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        lines = str(app.screen.query_one("#settings-error").render()).splitlines()
        assert lines == ["max steps per block: 'many' is not a whole number",
                         "first-step temperature: 5000 must be a temperature in [0.001, 1000]",
                         "entropy bound: -1 must be a number in [1e-12, 1e9]"]
