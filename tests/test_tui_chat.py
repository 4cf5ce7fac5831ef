"""The chat TUI's chat screen driven by Textual's Pilot (scripted backend, and the tiny real
model): the prompt, the canvas, replay, export, the status line, the canvas key."""

from __future__ import annotations

import json

import pytest

from mlx_dgemma.events import Stats
from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.engine import ModelBackend
from mlx_dgemma.tui.widgets.canvas import CanvasView
from mlx_dgemma.tui.widgets.chat_log import Answer

from .tui_fakes import ScriptedBackend
from .tui_helpers import SIZE, ask, done, failing_backend, screen, screen_text, send, status_row, wait_for


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
        assert s.cursor is not None and s._stats.prefill_tokens_per_second and s._stats.steps
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: backend.resets == 1)
        assert s.cursor is None and s._last_done is None and s._stats == Stats()  # no figure of the last answer
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


async def test_80x24_chat_footer_shows_every_binding():
    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        await wait_for(pilot, lambda: "esc" in screen_text(app))
        footer = [strip.text for strip in app.screen._compositor.render_strips()][-1]
        for key in ("esc", "^n", "^o", "^b", "^f", "^t", "^q Quit"):
            assert key in footer, footer


async def test_errors_are_shown_not_raised():
    app = DGemmaApp(failing_backend(RuntimeError("the GPU caught fire")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend.loaded)
        await send(pilot, "q")
        await wait_for(pilot, lambda: bool(screen(app).query(".error")))
        assert "the GPU caught fire" in str(screen(app).query_one(".error").render())
        assert not screen(app).busy


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


@pytest.mark.parametrize("width", [80, 120])
async def test_notices_sit_over_the_conversation_not_the_canvas_chart_or_status(width):
    """Textual puts toasts bottom right: over the entropy chart (and at 80 columns over the
    status line). They sit top left now, within the conversation's pane."""
    from textual.widgets._toast import Toast

    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=(width, 30), notifications=True) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        app.notify("A notice long enough to wrap over more than one line of the pane, as real ones do.")
        await wait_for(pilot, lambda: bool(app.screen.query(Toast)))
        await pilot.pause(0.1)
        toast = app.screen.query(Toast).first().region
        pane = app.screen.query_one("#chat-pane").region
        assert toast.x == pane.x and toast.right <= pane.right, (toast, pane)
        for other in ("#canvas", "#chart", "#status"):
            assert not toast.overlaps(app.screen.query_one(other).region), (other, toast)
