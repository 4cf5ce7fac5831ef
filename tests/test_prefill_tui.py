"""The TUI shows prefill progress of a long prompt and Escape stops it between chunks."""

from __future__ import annotations

import time

from mlx_dgemma.events import DoneEvent, PrefillProgressEvent
from mlx_dgemma.tui.app import DGemmaApp

from .tui_helpers import SIZE, done, screen, send, wait_for
from .tui_fakes import ScriptedBackend


class SlowPrefillBackend(ScriptedBackend):
    """Prefills 10,000 tokens in chunks of 1,000, polling ``cancel`` between chunks as
    stream_generate does."""

    def __init__(self):
        super().__init__()
        self.chunks = 0

    def stream(self, prompt, cancel, **params):
        self.prompts.append((prompt, params))
        for i in range(1, 11):
            time.sleep(0.05)
            self.chunks = i
            yield PrefillProgressEvent(tokens_done=1000 * i, tokens_total=10_000, seconds=0.05 * i)
            while i >= 2 and not cancel():  # hold after the second chunk until the user cancels
                time.sleep(0.02)
            if cancel():
                yield DoneEvent(text="", thinking="", tokens=(), finish_reason="cancelled", prompt_tokens=10_000,
                                prefill_seconds=0.05 * i, prefill_tokens_per_second=0.0, steps=0, steps_per_block=(),
                                seconds_per_step=0.0, tokens_per_forward=0.0, generation_seconds=0.0,
                                peak_memory_bytes=0)
                return


async def test_prefill_progress_is_shown_and_escape_cancels():
    backend = SlowPrefillBackend()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await send(pilot, "a long document")
        status = lambda: str(screen(app).query_one("#status").render())  # noqa: E731
        await wait_for(pilot, lambda: "prefill 2,000/10,000 tokens" in status())
        await pilot.press("escape")
        await wait_for(pilot, lambda: done(app))
        assert screen(app)._last_done.finish_reason == "cancelled"
        assert backend.chunks == 2  # stopped at the next chunk boundary
