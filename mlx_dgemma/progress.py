"""A small stderr progress bar (no dependency): redrawn in place on a terminal, a line per
10 % otherwise (logs, CI)."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


# An estimate from the first instants extrapolates start-up costs (opening, the first tensor's
# page faults) over the whole job: "~6187.4s left" a second in. None until this much is done.
ETA_MIN_FRACTION = 0.02
ETA_MIN_SECONDS = 2.0


def clock(seconds: float) -> str:
    """``m:ss`` below an hour, ``h:mm:ss`` above."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def eta(done_fraction: float, elapsed: float) -> str | None:
    """The time left as ``m:ss`` / ``h:mm:ss``, or None while too little is done to tell."""
    if done_fraction < ETA_MIN_FRACTION or elapsed < ETA_MIN_SECONDS or done_fraction >= 1:
        return None
    return clock(elapsed / done_fraction - elapsed)


def columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to (80 where it cannot tell)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):  # no fileno (a StringIO), not a terminal, closed
        return 80


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
        left = eta(frac, elapsed)
        fmt = ".0f" if self.scale == 1 else ".2f"
        timing = clock(elapsed) + " elapsed" + (f", ~{left} left" if left else "" if frac >= 1 else ", estimating")
        text = (f"{self.label} {frac:6.1%} {done / self.scale:{fmt}}/{total / self.scale:{fmt}} {self.unit}"
                f"  {timing}  {note}")
        if self.tty:
            if now - self._last_draw < 0.1 and done < total:
                return
            self._last_draw = now
            # one screen line: a longer one wraps, and "\r" then clears only its last row, so
            # every redraw would leave a line behind (hundreds over a long convert at 80 columns);
            # a narrow terminal gets a shorter bar, so the percentage stays in view
            cols = columns(self.stream)
            width = 24 if cols >= 80 else max(4, cols // 5)
            fill = int(frac * width)
            line = "[" + "#" * fill + " " * (width - fill) + "] " + text
            self.stream.write("\r\x1b[2K" + line[:max(1, cols - 1)])
            if done >= total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(text + "\n")
        self.stream.flush()
