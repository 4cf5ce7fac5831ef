"""The canvas panel: one cell per canvas position, coloured by state and entropy."""

from __future__ import annotations

import math
from typing import Callable

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from mlx_dgemma.text import printable

CELL = 7  # the narrowest cell: characters per token piece, plus one space
MAX_CELL = 16  # the widest: a long word whole, with room to spare cells stay this wide
MAX_ENTROPY = 6.0  # nats; brighter background = more uncertain

NOW, BEFORE, DRAFT = Style(color="bright_green", bold=True), Style(color="cyan"), Style(color="grey58", italic=True)
ENTROPY_KEY = "on rgb(140,70,45)"
# The legend, longest wording first: the first that fits the panel's width is shown whole
# (a legend cut at the edge used to lose "draft" and the entropy key). It opens with "key:" and
# marks each entry with a swatch: three bare words above a three-column grid read as column
# headers.
LEGENDS: list[tuple[str, list[tuple[str, Style | str]]]] = [
    ("key: ", [("accepted now", NOW), ("accepted before", BEFORE), ("draft", DRAFT),
               ("background = entropy", ENTROPY_KEY)]),
    ("key: ", [("accepted now", NOW), ("accepted before", BEFORE), ("draft", DRAFT), ("bg = entropy", ENTROPY_KEY)]),
    ("key: ", [("now", NOW), ("before", BEFORE), ("draft", DRAFT), ("bg = entropy", ENTROPY_KEY)]),
    ("", [("now", NOW), ("before", BEFORE), ("draft", DRAFT), ("bg=H", ENTROPY_KEY)]),
]
SWATCH = "■ "


def entropy_bg(h: float) -> str:
    """Dark (certain) to warm (uncertain), on a log scale."""
    x = min(1.0, math.log1p(max(0.0, h)) / math.log1p(MAX_ENTROPY))
    r, g, b = int(30 + 170 * x), int(30 + 60 * x), int(40 + 10 * (1 - x))
    return f"rgb({r},{g},{b})"


def legend_wordings() -> list[Text]:
    """Every wording of the colour key, longest first."""
    out = []
    for lead, entries in LEGENDS:
        sep = "  " if lead else " "
        parts: list[tuple[str, Style | str]] = [(lead, "dim")]
        for i, (label, style) in enumerate(entries):
            parts += [(sep, "")] * (i > 0) + [(SWATCH, style), (label, style)]
        out.append(Text.assemble(*parts, no_wrap=True))
    return out


def legend(width: int) -> Text:
    """The colour key in the longest wording that fits ``width`` columns (the shortest where none does)."""
    wordings = legend_wordings()
    return next((t for t in wordings if len(t.plain) <= width), wordings[-1])


def cell_width(width: int, height: int, positions: int) -> int:
    """Characters per cell (piece plus one space): as wide as lets every position fit in
    ``height`` rows, between CELL and MAX_CELL, so pieces are cut only where space is short."""
    rows = max(1, height)
    cols = max(1, -(-positions // rows))
    return max(CELL, min(MAX_CELL, width // cols))


class CanvasTitle(Widget):
    """Two lines above the canvas: which block and step it shows, and the colour key."""

    DEFAULT_CSS = "CanvasTitle { height: 2; }"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.heading = "canvas"
        self.keyed = False  # the key shows once there is a canvas to explain

    def show(self, heading: str) -> None:
        self.heading, self.keyed = heading, True
        self.refresh()

    def clear(self) -> None:
        self.heading, self.keyed = "canvas", False
        self.refresh()

    def render(self) -> Text:
        out = Text(self.heading, no_wrap=True, overflow="ellipsis")
        if self.keyed:
            out.append("\n")
            out.append_text(legend(self.size.width or 60))
        return out


class CanvasView(Widget):
    """Renders a StepEvent: accepted now (green), accepted earlier (cyan), draft (dim)."""

    def __init__(self, piece: Callable[[int], str] | None = None, **kw):
        super().__init__(**kw)
        self.piece = piece or str
        self.event = None
        self.earlier = None  # positions accepted at an earlier step of the same block

    def show(self, event, earlier) -> None:
        self.event, self.earlier = event, earlier
        self.refresh()

    def clear(self) -> None:
        self.event, self.earlier = None, None
        self.refresh()

    def render(self) -> Text:
        ev = self.event
        if ev is None:
            return Text("The canvas appears here while an answer is denoised.", style="dim italic")
        width = self.size.width or 80
        cell = cell_width(width, self.size.height or 1, ev.canvas.size)
        cols = max(1, width // cell)
        # A block commits the argmax canvas of its last step (the stopping rule or the step cap),
        # not that step's sampled draws: show what the answer will hold.
        last = ev.stopped or ev.step == ev.max_steps
        out = Text()
        for i in range(ev.canvas.size):
            acc = bool(ev.accepted[i])
            tok = int(ev.canvas[i] if acc and not last else ev.draft[i])
            piece = printable(self.piece(tok).replace("\n", "⏎").replace("\t", "⇥"))
            piece = (piece[: cell - 2] + "…") if len(piece) > cell - 1 else piece
            if acc and self.earlier is not None and self.earlier[i]:
                fg = BEFORE
            elif acc:
                fg = NOW
            else:
                fg = DRAFT
            out.append(piece.ljust(cell - 1), fg + Style(bgcolor=entropy_bg(float(ev.entropy[i]))))
            out.append("\n" if (i + 1) % cols == 0 else " ")
        return out
