"""Timing helpers shared by the measurements and the studies: synchronized wall-clock timing
of an MLX computation, and the progress log on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import mlx.core as mx


def sync_time(fn: Callable[[], Any], warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` evaluated calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(fn())  # MLX is lazy: the time is the evaluation's
        times.append(time.perf_counter() - t0)
    return times


def log(msg: str) -> None:
    """One timestamped progress line on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
