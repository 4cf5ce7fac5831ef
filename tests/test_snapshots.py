"""Snapshots of the main screen after a (scripted, deterministic) answer, the welcome screen
and the settings dialog. Update with ``pytest tests/test_snapshots.py --snapshot-update``."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot", reason="pytest-textual-snapshot not installed")

from mlx_dgemma.tui.app import DGemmaApp  # noqa: E402

from .tui_helpers import ask, wait_for  # noqa: E402
from .tui_fakes import ScriptedBackend  # noqa: E402

SIZE = (130, 36)


async def settle(pilot):
    from mlx_dgemma.tui.widgets.chat_log import Answer

    for a in pilot.app.screen.query(Answer):  # Markdown renders asynchronously
        await wait_for(pilot, lambda a=a: a.rendered == a.target)
    pilot.app.screen.set_focus(None)  # no blinking cursor in the picture
    pilot.app.clear_notifications()


def test_main_screen_after_an_answer(snap_compare):
    backend = ScriptedBackend(steps=4, blocks=2)

    async def run_before(pilot):
        await ask(pilot, backend, "Why is the sky blue?")
        await pilot.pause(0.2)
        await settle(pilot)
        await pilot.pause()

    assert snap_compare(DGemmaApp(backend), terminal_size=SIZE, run_before=run_before)


def test_replay_view(snap_compare):
    backend = ScriptedBackend(steps=4, blocks=2)

    async def run_before(pilot):
        await ask(pilot, backend, "q")
        for _ in range(5):
            await pilot.press("ctrl+b")
        await settle(pilot)
        await pilot.pause()

    assert snap_compare(DGemmaApp(backend), terminal_size=SIZE, run_before=run_before)


def test_welcome_screen(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.pause()

    assert snap_compare(DGemmaApp(None), terminal_size=SIZE, run_before=run_before)


def test_settings_dialog(snap_compare):
    backend = ScriptedBackend()

    async def run_before(pilot):
        await wait_for(pilot, lambda: backend.loaded)
        await pilot.press("ctrl+o")
        await pilot.pause()
        await settle(pilot)
        await pilot.pause()

    assert snap_compare(DGemmaApp(backend), terminal_size=(130, 40), run_before=run_before)


def test_failed_load_at_80x24(snap_compare):
    from .tui_helpers import FailingLoad

    async def run_before(pilot):
        from mlx_dgemma.tui.screens.welcome import WelcomeScreen

        await wait_for(pilot, lambda: isinstance(pilot.app.screen, WelcomeScreen))
        # the screen focuses its first button (the demo: Enter starts it) once it is active, which
        # on a busy machine can come after any clearing of the focus: the picture shows it focused
        await wait_for(pilot, lambda: pilot.app.screen.focused is not None)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(DGemmaApp(FailingLoad()), terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
def test_replay_view_at_80_and_100_columns(snap_compare, size):
    # the status line leaves out whole parts, least important first: the precision is never cut
    backend = ScriptedBackend(steps=4, blocks=2)

    async def run_before(pilot):
        await ask(pilot, backend, "Why is the sky blue?")
        await pilot.press("ctrl+b")
        await settle(pilot)
        await pilot.pause()

    assert snap_compare(DGemmaApp(backend), terminal_size=size, run_before=run_before)
