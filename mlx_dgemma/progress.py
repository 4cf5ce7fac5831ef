"""A small stderr progress bar (no dependency): redrawn in place on a terminal, a line per
10 % otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, unit: str = "GB", scale: float = 1e9, stream: TextIO | None = None):
        self.label, self.unit, self.scale = label, unit, scale
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1
        self._last_draw = 0.0

    def update(self, done: float, total: float, note: str = "") -> None:
        frac = done / total if total else 1.0
        now = time.perf_counter()
        elapsed = now - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        fmt = ".0f" if self.scale == 1 else ".2f"
        text = (f"{self.label} {frac:6.1%} {done / self.scale:{fmt}}/{total / self.scale:{fmt}} {self.unit}"
                f"  {elapsed:5.1f}s elapsed, ~{eta:5.1f}s left  {note}")
        if self.tty:
            if now - self._last_draw < 0.1 and done < total:
                return
            self._last_draw = now
            width = 24
            fill = int(frac * width)
            self.stream.write("\r\x1b[2K[" + "#" * fill + " " * (width - fill) + "] " + text[:120])
            if done >= total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(text + "\n")
        self.stream.flush()
