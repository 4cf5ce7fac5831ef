"""The status line: block, step, temperature, speed, memory, the model's facts; or an answer's summary.

A terminal 80 columns wide cannot show every number: the line is made of parts, each with a
rank, and the parts that do not fit are left out whole, least important first, rather than the
line being cut at the edge (which used to cut the precision label in half at 100 columns).
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.widgets import Static

from mlx_dgemma.events import DoneEvent, StepEvent

SEP = "  "
Parts = list[tuple[str, int]]  # (text, rank): rank 0 is always shown, higher ranks go first


def fit(parts: Parts, width: int, sep: str = SEP) -> str:
    """``parts`` joined by ``sep`` in their order, leaving out the highest-ranked parts (the
    rightmost of equal rank first) until the line is at most ``width`` characters."""
    keep = list(parts)
    while len(sep.join(t for t, _ in keep)) > width and any(rank for _, rank in keep):
        worst = max(range(len(keep)), key=lambda i: (keep[i][1], i))
        del keep[worst]
    return sep.join(t for t, _ in keep)


def step_parts(ev: StepEvent, blocks: int, spf: float, tpf: float | None, prefill_tps: float | None,
               memory: int, note: str = "", facts: Iterable[str] = ()) -> Parts:
    """The live (or replayed) step: where, how hot, how fast, how much memory, and ``facts``: the
    model's facts both front ends show (:meth:`mlx_dgemma.host.ModelInfo.shown_words`: which precision)."""
    # <=: the blocks max new tokens allows, an answer may end sooner ("block 1/4" read as 1 of 4)
    parts = [(f"block {ev.block}/≤{blocks}", 0), (f"step {ev.step}/{ev.max_steps}", 0),
             (f"T={ev.temperature:.3f}", 3), (f"{ev.seconds if spf == 0 else spf:.2f} s/step", 1)]
    if tpf is not None:
        parts.append((f"{tpf:.2f} tok/fwd", 4))
    if prefill_tps is not None:
        parts.append((f"prefill {prefill_tps:.0f} tok/s", 4))
    parts.append((f"mem {memory / 1e9:.2f} GB", 2))
    for fact in facts:  # e.g. which runtime precision is running: "fast (bfloat16)", "exact (float32)"
        parts.append((fact, 1))
    if note:
        parts.append((note, 0))
    return parts


FINISHED = {"eos": "finished: end of turn", "length": "stopped: max new tokens reached",
            # the core's answer guards (mlx_dgemma.guards), each turned off in the settings (0)
            "repetition": "ended: a repetition loop was trimmed",
            "duplicate": "ended: a repeated copy was dropped",
            "unconverged": "ended: a block did not converge"}


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def finish_words(done: DoneEvent, at: tuple[int, int] | None = None) -> str:
    """Why the answer ended, in words. ``at``: the block and step (both from 1) a cancelled
    answer had reached, when it reached any; one with no prompt tokens never started (it was
    cancelled while it waited for the model)."""
    if done.finish_reason == "cancelled":
        if at:
            return f"cancelled at block {at[0]}, step {at[1]}"
        return "cancelled during the prefill" if done.prompt_tokens else "cancelled before it started"
    return FINISHED.get(done.finish_reason, done.finish_reason)


def summary_parts(done: DoneEvent, at: tuple[int, int] | None = None) -> Parts:
    """A finished answer: why it stopped, its steps and speed, peak memory, the keys to go on.
    Figures an answer did not produce are left out (a cancelled first block has no tokens per
    forward; a cancelled prefill has no steps), never shown as 0."""
    parts = [(finish_words(done, at), 0)]
    if done.finish_reason != "cancelled":
        parts.append((plural(len(done.steps_per_block), "block"), 4))
    if done.steps:
        parts += [(plural(done.steps, "step"), 1), (f"{done.seconds_per_step:.2f} s/step", 1)]
    if done.tokens_per_forward > 0:
        parts.append((f"{done.tokens_per_forward:.2f} tok/fwd", 4))
    if done.prefill_tokens_per_second > 0:
        parts.append((f"prefill {done.prefill_tokens_per_second:.0f} tok/s", 4))
    parts.append((f"peak {done.peak_memory_bytes / 1e9:.2f} GB", 2))
    if done.precision:
        parts.append((done.precision, 1))
    if done.steps:
        parts += [("ctrl+b/f replay", 3), ("ctrl+t export", 3)]
    return parts


class StatusLine(Static):
    """One line of plain text (no markup: paths and errors may hold brackets)."""

    def __init__(self, text: str = "", **kw):
        super().__init__(text, markup=False, **kw)
        self.parts: Parts | None = None  # set by show_parts; fitted to the width at each render

    def update(self, content="", *, layout: bool = True) -> None:
        self.parts = None
        super().update(content, layout=layout)

    def show_parts(self, parts: Parts) -> None:
        self.parts = parts
        self.refresh()

    def show_step(self, ev: StepEvent, blocks: int, spf: float, tpf: float | None, prefill_tps: float | None,
                  memory: int, note: str = "", facts: Iterable[str] = ()) -> None:
        self.show_parts(step_parts(ev, blocks, spf, tpf, prefill_tps, memory, note, facts))

    def show_summary(self, done: DoneEvent, at: tuple[int, int] | None = None) -> None:
        self.show_parts(summary_parts(done, at))

    @property
    def text(self) -> str:
        """What the line shows now (at its current width)."""
        return str(self.render())

    def render(self):
        if self.parts is None:
            return super().render()
        return Text(fit(self.parts, self.content_region.width or 78), no_wrap=True)
