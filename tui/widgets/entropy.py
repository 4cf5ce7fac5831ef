"""Per-step chart of the current block: mean entropy and accepted positions per step."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def spark(values: list[float], top: float) -> str:
    if not values:
        return ""
    top = top or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(len(BARS) * v / top))] if v > 0 else " " for v in values)


class EntropyChart(Widget):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.entropy: list[float] = []
        self.accepted: list[int] = []
        self.steps: list[tuple[int, int]] = []
        self.canvas = 0
        self.cursor: int | None = None

    def set_block(self, steps, canvas: int, cursor: int | None = None) -> None:
        self.entropy = [s.mean_entropy for s in steps]
        self.accepted = [int(s.accepted.sum()) for s in steps]
        self.steps = [(s.step, s.max_steps) for s in steps]  # numbered as the status line numbers them
        self.canvas = canvas
        self.cursor = cursor
        self.refresh()

    def render(self) -> Text:
        t = Text()
        if not self.entropy:
            t.append("mean entropy and accepted positions per step of the current block", style="dim italic")
            return t
        logs = [math.log1p(e) for e in self.entropy]
        width = max(8, (self.size.width or 60) - 18)
        tail = slice(max(0, len(logs) - width), None)
        t.append("mean entropy  ", style="bold")
        t.append(spark(logs[tail], max(logs) or 1.0) + "\n", style="yellow")
        t.append("accepted      ", style="bold")
        t.append(spark([float(a) for a in self.accepted[tail]], float(self.canvas or 1)) + "\n", style="green")
        k = self.cursor if self.cursor is not None else len(self.entropy) - 1
        step, max_steps = self.steps[k]
        t.append(f"step {step}/{max_steps}: H={self.entropy[k]:.4f}  "
                 f"accepted {self.accepted[k]}/{self.canvas}", style="dim")
        return t
