"""Ctrl+Q always quits: even while the engine thread is stuck (a load or a render that does
not return), the app closes and no thread is left that would keep the process alive."""

from __future__ import annotations

import threading

from mlx_dgemma.tui.app import DGemmaApp
from tests.tui_fakes import GatedLoad


async def test_ctrl_q_quits_while_the_load_is_stuck():
    backend = GatedLoad("stuck", finish=False, wait_s=120)  # a load that does not come back (a hung parser)
    app = DGemmaApp(backend)
    try:
        async with app.run_test() as pilot:
            await pilot.pause(0.3)
            await pilot.press("ctrl+q")
            await pilot.pause(0.3)
            assert not app.is_running
        # interpreter exit joins every non-daemon thread: none may be left serving the engine
        blocking = [t.name for t in threading.enumerate()
                    if t is not threading.main_thread() and not t.daemon and t.is_alive()]
        assert blocking == []
    finally:
        backend.release.set()
