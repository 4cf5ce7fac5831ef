"""The main screen: conversation on the left, the denoising canvas and its chart on the right."""

from __future__ import annotations

import time
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Input

from mlx_dgemma.errors import DGemmaError
from mlx_dgemma.events import BlockEvent, DoneEvent, PrefillProgressEvent, Stats, StepEvent
from mlx_dgemma.host import ModelInfo
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.trace import Trace, settings_in_effect, trace_header

from ..engine import Backend
from ..messages import EngineError, EngineEvent, EngineStatus
from ..widgets.banner import DemoBanner
from ..widgets.canvas import CanvasTitle, CanvasView
from ..widgets.chat_log import Answer, ChatLog
from ..widgets.entropy import EntropyChart
from ..widgets.status import StatusLine, finish_words

# Steps are coalesced by a 15 Hz timer (``_flush``), not by Message.can_replace: each
# EngineEvent is handled (the step goes into the trace: export and replay need every one) and
# only remembered as ``_pending``; the timer draws the newest. can_replace would drop the
# replaced steps before any handler saw them (holes in the trace), and it only coalesces steps
# that happen to be queued together, so it does not bound the redraw rate; the timer does,
# whatever the arrival pattern (a fast model on a GPU, or a burst after a slow redraw).
REFRESH_HZ = 15
PLACEHOLDERS = {"loading": "Loading the model…",
                "ready": "Message (Enter to send)", "busy": "Answering… (Esc cancels)"}  # 26 columns at 80x24


class ChatScreen(Screen):
    # Short labels: the footer, ^q Quit included, fits an 80-column terminal.
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "settings", "Settings"),
        Binding("ctrl+b", "replay(-1)", "Back"),
        Binding("ctrl+f", "replay(1)", "Fwd"),
        Binding("ctrl+t", "export", "Export"),
    ]

    # An answer is under way: the prompt's placeholder follows (see watch_busy). Every
    # assignment is watched: a "ready" after the load must replace "Loading the model…".
    busy: reactive[bool] = reactive(False, always_update=True, init=False)
    # The replay position (block and step index in the trace, from 0); None: live, the timer
    # draws the newest step. Moving it redraws that step (see watch_cursor).
    cursor: reactive[tuple[int, int] | None] = reactive(None, init=False)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.trace = Trace()
        self.answer: Answer | None = None
        self.answer_id = 0
        self.params: dict = {}  # sampler overrides (Ctrl+O)
        self.think = False  # the thought channel, per answer (--think, Ctrl+O)
        self.system: str | None = None  # the system prompt of the next new chat (--system, Ctrl+O)
        self.turn = 0  # user messages in this chat
        self._sent = ""  # the last message sent
        self._pending: StepEvent | None = None
        self._stats = Stats()  # the answer's figures so far (the status line's speeds)
        self._blocks_planned = 1
        self._last_done: DoneEvent | None = None

    @property
    def backend(self) -> Backend:
        return self.app.backend

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts, the host's (None while it loads)."""
        engine = self.app.engine
        return engine.info if engine is not None else None

    def compose(self) -> ComposeResult:
        backend = self.backend
        if backend.is_demo:  # one row across the screen, not several in the narrow chat pane
            yield DemoBanner(id="demo-banner")
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield ChatLog(id="chat-log")
                yield Input(placeholder=PLACEHOLDERS["loading"], id="prompt")
            with Vertical(id="diffusion-pane"):
                yield CanvasTitle(id="canvas-title")
                yield CanvasView(piece=backend.piece, id="canvas")
                yield EntropyChart(id="chart")
        yield StatusLine("starting…", id="status")
        yield Footer(compact=True)  # every binding, ^q Quit included, fits 80 columns

    def watch_busy(self, busy: bool) -> None:
        self.query_one("#prompt", Input).placeholder = PLACEHOLDERS["busy" if busy else "ready"]

    def watch_cursor(self, cursor: tuple[int, int] | None) -> None:
        if cursor is not None:  # back to live (None): the next step, or a cleared canvas, shows
            self._draw(*cursor)

    def on_mount(self) -> None:
        self.think, self.system = self.backend.think, self.backend.system
        self.params = dict(getattr(self.backend, "sampler", None) or {})
        self._show_modes()
        self.set_interval(1 / REFRESH_HZ, self._flush)
        self.query_one(Input).focus()

    # engine -> UI ---------------------------------------------------------------------------

    @on(EngineStatus)
    def _on_status(self, m: EngineStatus) -> None:
        if self.app.stopping:
            return  # quitting: the status line says "stopping…" until the engine has stopped
        # every state shows: the status line says what happens, the prompt whether to type
        status, prompt = self.query_one(StatusLine), self.query_one("#prompt", Input)
        if m.state == "loading":
            status.update(f"loading: {m.detail}")
            prompt.placeholder = PLACEHOLDERS["loading"]
        elif m.state == "ready":
            self.busy = False
            if m.detail:  # the model is loaded (after an answer the status line keeps its summary)
                status.update(f"ready: {m.detail}")
        elif m.state == "busy":
            self.busy = True
            status.update("answering: prefill…  escape: cancel")  # until the first step is drawn
        elif m.state == "failed":
            self.app.load_failed(m.detail)
        else:  # EngineStatus refuses unknown states; a new one must be handled here
            raise AssertionError(f"unhandled engine state {m.state!r}")

    @on(EngineError)
    def _on_error(self, m: EngineError) -> None:
        self.busy = False
        prompt = self.query_one("#prompt", Input)
        if m.answer_id == self.answer_id and self._sent and not prompt.value:
            # the message failed (too long for the context, say): give it back to edit and resend
            prompt.value = self._sent
        self.query_one(ChatLog).add_notice(f"error: {m.message}", error=True)
        self.query_one(StatusLine).update(f"error: {m.message}")

    @on(EngineEvent)
    def _on_event(self, m: EngineEvent) -> None:
        if m.answer_id != self.answer_id or self.app.stopping:
            return  # a late event of an answer the user has left, or the app is quitting
        ev = m.event
        self._stats.add(ev)
        if isinstance(ev, PrefillProgressEvent):  # a long prompt: chunks done so far; Escape stops between chunks
            self.query_one(StatusLine).update(f"prefill {ev.tokens_done:,}/{ev.tokens_total:,} tokens "
                                              f"({ev.seconds:.0f} s)  escape: cancel")
        elif isinstance(ev, StepEvent):
            self.trace.add(ev)
            self._pending = ev  # drawn by the timer: steps are coalesced, not each redrawn
        elif isinstance(ev, BlockEvent) and self.answer is not None:
            self.answer.set_text(ev.text, ev.thinking)
        elif isinstance(ev, DoneEvent):
            self._last_done = ev
            if self.answer is not None:
                note = "" if ev.finish_reason == "eos" else f"({finish_words(ev, self._reached())})"
                self.answer.set_text(ev.text, ev.thinking, note)
            self._flush()
            self._show_summary(ev)

    def _flush(self) -> None:
        ev, self._pending = self._pending, None
        if ev is None or self.cursor is not None or self.app.stopping:
            return
        self._draw(ev.block - 1, len(self.trace.blocks[ev.block - 1]) - 1)  # trace index from 0, block from 1

    def _draw(self, block: int, index: int) -> None:
        steps = self.trace.blocks[block]
        ev = steps[index]
        earlier = None
        if index > 0:
            import numpy as np

            earlier = np.any([s.accepted for s in steps[:index]], axis=0)
        live = "" if self.cursor is None else "  (replay)"
        self.query_one(CanvasTitle).show(
            f"canvas: block {ev.block}, step {ev.step}/{ev.max_steps}{live}")
        self.query_one(CanvasView).show(ev, earlier)
        self.query_one(EntropyChart).set_block(steps, ev.canvas.size, index)
        spf = self._stats.seconds_per_step
        done = self._last_done
        tpf = done.tokens_per_forward if done and done.tokens_per_forward > 0 else None  # none if no block was committed
        engine, info = self.app.engine, self.info
        # the memory as the worker sampled it (the UI thread never calls MLX); the facts both front ends show
        self.query_one(StatusLine).show_step(
            ev, max(self._blocks_planned, len(self.trace.blocks)), spf,
            tpf, self._stats.prefill_tokens_per_second or None, engine.memory_bytes if engine is not None else 0,
            "replay ^b/^f" if self.cursor is not None else "",
            facts=info.shown_words() if info is not None else ())

    def _reached(self) -> tuple[int, int] | None:
        """The block and step (both from 1) the answer had reached, if it reached any: the
        block is counted in the trace, so it does not depend on how events number blocks."""
        if not self.trace.blocks or not self.trace.blocks[-1]:
            return None
        return len(self.trace.blocks), self.trace.blocks[-1][-1].step

    def _show_summary(self, done: DoneEvent) -> None:
        self.query_one(StatusLine).show_summary(done, self._reached())

    # user actions ---------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _send(self, m: Input.Submitted) -> None:
        text = m.value.strip()
        if not text:
            return
        if self.busy:
            self.app.notify("Still answering; press Escape to cancel first.", severity="warning")
            return
        try:  # the settings as the core's request, checked once here (the dialog checked them too)
            request = GenerationRequest.of(self.params)
        except DGemmaError as e:
            self.query_one(StatusLine).update(f"error: {e}")
            return
        m.input.value = ""
        self._sent = text  # back into the prompt if the answer fails (_on_error)
        self.answer_id += 1
        self.turn += 1
        self._forget_answer(Trace(header=self._trace_header(text, request)))
        log = self.query_one(ChatLog)
        log.add_user(text)
        self.answer = log.add_answer(self.answer_id)
        info = self.info
        canvas = info.canvas_length if info is not None else 256
        defaults = info.generation_config if info is not None else {}
        max_new = int(request.get("max_new_tokens") or defaults.get("max_new_tokens", 256))
        self._blocks_planned = -(-max_new // canvas)
        self.busy = True
        self.app.engine.generate(text, request, self.answer_id, think=self.think)

    def _forget_answer(self, trace: Trace) -> None:
        """The one place that drops the last answer's steps, figures and canvas (a new answer,
        a new chat): nothing of it can show in the next one."""
        self.trace = trace
        self.cursor = None
        self._pending = None
        self._last_done = None
        self._stats = Stats()
        self.query_one(CanvasView).clear()

    def _trace_header(self, prompt: str, request: GenerationRequest) -> dict:
        """The exported trace's first record: the message, the settings in effect, the model."""
        info = self.info
        params = request.resolve(info.generation_config if info is not None else {})
        settings = settings_in_effect(params, self.backend.sc_top_k(params))
        return trace_header(prompt, settings, self.backend.label, info.precision if info is not None else "",
                            seed=settings.pop("seed"), thinking=self.think, system=self.system,
                            turn=self.turn)

    def action_cancel(self) -> None:
        if self.busy:
            self.app.engine.cancel()
            self.app.notify("Cancelling at the next step…")

    def action_new_chat(self) -> None:
        if self.busy:
            self.app.engine.cancel()
        self.answer_id += 1
        self.app.engine.reset(self.system)
        self.turn = 0
        self.answer = None
        self._forget_answer(Trace())
        self.query_one(ChatLog).remove_children()
        self.query_one(CanvasTitle).clear()
        self.query_one(EntropyChart).set_block([], 0)
        self.query_one(StatusLine).update("new chat")

    def action_settings(self) -> None:
        from .settings import Settings, SettingsScreen, describe

        def done(result: Settings | None) -> None:
            if result is None:
                return
            self.params, self.think = result.sampler, result.think
            if result.system != self.system:  # the system prompt opens a conversation: a new one
                self.system = result.system
                self.action_new_chat()
                self.app.notify("New chat with " + ("the new system prompt." if self.system else "no system prompt."))
            self._show_modes()
            self.app.notify(describe(result))

        defaults = dict(self.info.generation_config) if self.info is not None else {}
        self.app.push_screen(SettingsScreen({**defaults, **self.params}, defaults, self.think, self.system), done)

    def _show_modes(self) -> None:
        """The modes that change every answer, on the prompt's border: they are set once (flags,
        Ctrl+O) and otherwise visible nowhere while one chats."""
        modes = [m for m, on in (("thinking on", self.think), ("system prompt set", self.system)) if on]
        self.query_one("#prompt", Input).border_title = " · ".join(modes) or None

    def action_replay(self, delta: int) -> None:
        steps = self.trace.steps
        if not steps or self.busy:
            if self.busy:
                self.app.notify("Replay is available once the answer is done.", severity="warning")
            return
        pos = steps.index(self.cursor) if self.cursor in steps else len(steps) - 1
        pos = max(0, min(len(steps) - 1, pos + delta))
        self.cursor = steps[pos]

    def action_export(self) -> None:
        if not self.trace.blocks:
            self.app.notify("Nothing to export yet.", severity="warning")
            return
        out = Path(self.app.trace_dir) / f"mlx-dgemma-trace-{time.strftime('%Y%m%d-%H%M%S')}-{self.answer_id}.jsonl"
        try:
            path = self.trace.export_jsonl(out, self.backend.decode)
        except (OSError, DGemmaError) as e:  # a trace directory gone or unwritable: said, not a crash
            self.app.notify(f"Export failed: {e}", severity="error")
            return
        self.app.last_export = path
        self.app.notify(f"Trace written to {path.resolve()}")
