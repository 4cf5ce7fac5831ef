"""What the server measures, and /metrics' text: one answer's clock (:class:`Timings`: the
answer's llama.cpp ``timings``, read also by the request's log line and the counters), the
latency histograms and Prometheus' text format. Standard library and the events only; the engine
updates them on the worker thread."""

from __future__ import annotations

import math
from typing import Any, Callable

from mlx_dgemma.events import Stats

# /metrics' latency buckets (seconds), from an answer in a block to a request that waits minutes
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# the latency histograms, each (key, help): seconds from a request's arrival to its first turn,
# its first committed block, its answer
LATENCIES = (("queue", "from arrival to the first turn on the model"),
             ("first_block", "from arrival to the first committed block"),
             ("total", "from arrival to the answer"))


# /metrics' counters and gauges, each (name, Prometheus type, how it is read from the engine, help)
METRICS: tuple[tuple[str, str, Callable[[Any], float], str], ...] = (
    ("requests_served_total", "counter", lambda e: e.served, "requests the worker ran to an end"),
    ("requests_cancelled_total", "counter", lambda e: e.totals["cancelled"], "requests stopped before their answer"),
    ("requests_refused_total", "counter", lambda e: e.totals["refused"], "requests refused with 503 (queue full)"),
    ("requests_rejected_total", "counter", lambda e: e.totals["rejected"],
     "requests answered with a 4xx error (bad body or field, unknown route, too large, refused by the guard)"),
    ("connections_refused_total", "counter", lambda e: e.totals["connections_refused"],
     "connections refused, or closed to make room, with 503 (--max-connections)"),
    ("tool_call_repairs_total", "counter", lambda e: e.totals["tool_repairs"],
     "forced tool calls that needed the repair pass"),
    ("prompt_tokens_total", "counter", lambda e: e.totals["prompt_tokens"], "prompt tokens of answered requests"),
    ("prompt_tokens_cached_total", "counter", lambda e: e.totals["cached_tokens"],
     "prompt tokens taken from the cache"),
    ("completion_tokens_total", "counter", lambda e: e.totals["completion_tokens"], "tokens answered"),
    ("denoising_steps_total", "counter", lambda e: e.totals["steps"], "decoder passes (denoising steps)"),
    ("requests_waiting", "gauge", lambda e: e.waiting, "requests waiting for their first turn"),
    ("requests_running", "gauge", lambda e: e.worker.in_progress, "requests taking turns on the model"),
    ("worker_busy", "gauge", lambda e: int(e.busy), "1 while the worker runs a request"),
    ("memory_bytes", "gauge", lambda e: e.host.memory_bytes, "memory the process holds after the last turn"),
)


class Histogram:
    """A Prometheus histogram of seconds (cumulative buckets, sum, count); updated on the worker
    thread, read by /metrics (a slightly stale read is harmless)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))
        self.counts[i] += 1
        self.sum += seconds

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for b, n in zip((*BUCKETS, math.inf), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{"+Inf" if b == math.inf else b}"}} {total}')
        return out + [f"{name}_sum {round(self.sum, 6)}", f"{name}_count {total}"]


class Timings(Stats):
    """One answer's clock, from its events (:meth:`~mlx_dgemma.events.Stats.add`): llama.cpp's
    ``timings`` (prompt_n, prompt_ms, predicted_n, predicted_ms and their rates) with the
    ``diffusion`` part its DiffusionGemma server adds (blocks, steps, canvas tokens, ms per step,
    canvas tokens per second), from the figures the core's DoneEvent reports too."""

    def __init__(self, canvas: int):
        super().__init__()
        self.canvas = canvas

    def timings(self, cached: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
        """The ``timings`` object: ``prompt_n`` tokens encoded (``cache_n`` taken from the cache),
        ``predicted_n`` answer tokens (usage's completion_tokens) from the prompt's end to now."""
        prompt_ms = 1000 * self.prefill_seconds
        predicted_ms = 1000 * self.generation_seconds

        def per_token(ms: float, n: int) -> float | None:
            return round(ms / n, 3) if n else None

        def per_second(ms: float, n: int) -> float | None:
            return round(1000 * n / ms, 2) if ms > 0 else None

        ms_step = 1000 * self.step_seconds / self.steps if self.steps else None
        return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
                "prompt_per_second": per_second(prompt_ms, prompt_n),
                "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": per_token(predicted_ms, predicted_n),
                "predicted_per_second": per_second(predicted_ms, predicted_n),
                "diffusion": {"blocks": len(self.steps_per_block), "steps": self.steps,
                              "steps_per_block": list(self.steps_per_block), "canvas_tokens": self.canvas,
                              "ms_per_step": round(ms_step, 3) if ms_step is not None else None,
                              # tokens the decoder denoised per second: a canvas per step
                              "canvas_tokens_per_second": per_second(1000 * self.step_seconds,
                                                                     self.canvas * self.steps)}}


def prometheus_text(metrics: list[tuple[str, str, float, str]], latency: dict[str, Histogram]) -> str:
    """/metrics in Prometheus' text format: ``metrics`` ((name, type, value, help) of the counters
    and gauges) and the latency histograms (:data:`LATENCIES`)."""
    lines = []
    for name, kind, value, help_text in metrics:
        lines += [f"# HELP mlx_dgemma_{name} {help_text}", f"# TYPE mlx_dgemma_{name} {kind}",
                  f"mlx_dgemma_{name} {value}"]
    for what, help_text in LATENCIES:
        name = f"mlx_dgemma_request_{what}_seconds"
        lines += [f"# HELP {name} seconds {help_text}", f"# TYPE {name} histogram", *latency[what].lines(name)]
    return "\n".join(lines) + "\n"
