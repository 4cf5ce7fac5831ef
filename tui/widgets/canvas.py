"""The canvas panel: one cell per canvas position, coloured by state and entropy."""

from __future__ import annotations

import math
from typing import Callable

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from mlx_dgemma.text import printable

CELL = 7  # characters per token piece, plus one space
MAX_ENTROPY = 6.0  # nats; brighter background = more uncertain


def entropy_bg(h: float) -> str:
    """Dark (certain) to warm (uncertain), on a log scale."""
    x = min(1.0, math.log1p(max(0.0, h)) / math.log1p(MAX_ENTROPY))
    r, g, b = int(30 + 170 * x), int(30 + 60 * x), int(40 + 10 * (1 - x))
    return f"rgb({r},{g},{b})"


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
        cols = max(1, (self.size.width or 80) // CELL)
        out = Text()
        for i in range(ev.canvas.size):
            acc = bool(ev.accepted[i])
            tok = int(ev.canvas[i] if acc else ev.draft[i])
            piece = printable(self.piece(tok).replace("\n", "⏎").replace("\t", "⇥"))
            piece = (piece[: CELL - 2] + "…") if len(piece) > CELL - 1 else piece
            if acc and self.earlier is not None and self.earlier[i]:
                fg = Style(color="cyan")
            elif acc:
                fg = Style(color="bright_green", bold=True)
            else:
                fg = Style(color="grey58", italic=True)
            out.append(piece.ljust(CELL - 1), fg + Style(bgcolor=entropy_bg(float(ev.entropy[i]))))
            out.append("\n" if (i + 1) % cols == 0 else " ")
        return out
