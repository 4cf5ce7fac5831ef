"""Batched denoising steps: does running B requests' canvases as one batch pay on this backend?

    python benchmarks/batch_step.py [--models demo,medium] [--batches 1,4,8] [--reps 3] [--json out.json]

The server answers parallel requests one after another. Batching them would run the B
canvases waiting at a block boundary through one decoder pass ([B, C] instead of B passes of
[1, C]). This measures what that saves, before building it: the real compiled step
(``StepFunction``: decoder pass with self-conditioning, sampler, stopping rule) over

* serial: B calls, one per request, each on its own KV cache (what the server's worker runs);
* batched: one call over the B canvases stacked, each sequence with its own prompt of a
  different length: the caches are stacked along the batch axis, global layers padded to the
  largest capacity, and every sequence keeps its own slot positions (its own attention mask)
  and its own RoPE offset. The batched logits are checked against each sequence run alone.

Serial and batched calls alternate (A/B) to cancel machine drift; medians are reported, with
the machine's load average before and after. ``speedup`` = serial / batched time for the same
B steps: the most a batching server could gain in throughput on a step-bound workload (prefill,
committing blocks and HTTP are left out, and they do not batch better). Models: the trained
demo (canvas 64) and the bench's random ``medium`` config (canvas 256), both in the runtime
precision the server loads (``auto``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlx_dgemma import Runtime, load, load_demo
from mlx_dgemma.bench.configs import build
from mlx_dgemma.bench.flops import dense_matmul_gflops, step_flops
from mlx_dgemma.bench.report import emit, machine
from mlx_dgemma.cache import KVCache, LayerCache
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import OUTPUTS, StepFunction

# Prompt lengths of the B sequences, evenly spread over [lo, hi]; the demo's range crosses a
# global-layer bucket (1024 slots), so its batch of 8 also pays for padding a cache.
PROMPTS = {"demo": (24, 1150), "medium": (64, 640)}


class StackedLayer(LayerCache):
    """One layer of B sequences' caches: keys/values [B, Hkv, S, D], slot positions [B, S]."""

    @classmethod
    def stack(cls, layers: list[LayerCache]) -> "StackedLayer":
        first = layers[0]
        out = cls(first.sliding, first.window, first.bucket)
        if any(c.keys is None for c in layers):
            raise ValueError("every sequence needs a filled cache")
        S = max(c.capacity for c in layers)

        def pad(a: mx.array, fill: float) -> mx.array:  # [1, H, s, D] or [s] -> S slots
            extra = S - a.shape[-2 if a.ndim == 4 else -1]
            if not extra:
                return a
            shape = (*a.shape[:2], extra, a.shape[3]) if a.ndim == 4 else (extra,)
            return mx.concatenate([a, mx.full(shape, fill, dtype=a.dtype)], axis=2 if a.ndim == 4 else 0)

        out.keys = mx.concatenate([pad(c.keys, 0) for c in layers])
        out.values = mx.concatenate([pad(c.values, 0) for c in layers])
        out.pos = mx.stack([pad(c.pos, -1) for c in layers])  # -1: an empty (never attended) slot
        return out

    def attend(self, k: mx.array, v: mx.array, offset: mx.array,
               encode: bool) -> tuple[mx.array, mx.array, mx.array]:
        if encode:
            raise NotImplementedError("a stacked cache is only read by the denoiser")
        n = k.shape[2]
        keys = mx.concatenate([self.keys, k], axis=2)
        values = mx.concatenate([self.values, v], axis=2)
        visible = mx.concatenate([self.pos >= 0, mx.ones((k.shape[0], n), dtype=mx.bool_)], axis=1)
        return keys, values, visible[:, None, None, :]  # [B, 1, 1, S + n]: each sequence its own mask

    def step_state(self) -> list[mx.array]:
        return self.state()  # every slot: the padding is masked per sequence, not cut

    def with_state(self, arrays: list[mx.array]) -> "StackedLayer":
        view = StackedLayer(self.sliding, self.window, self.bucket)
        view.keys, view.values, view.pos = arrays
        return view


class StackedCache(KVCache):
    """B sequences' KV caches as one batch; ``offset`` [B] (each canvas's own RoPE positions)."""

    def __init__(self, caches: list[KVCache]):
        self.layers = [StackedLayer.stack([c[i] for c in caches]) for i in range(len(caches[0].layers))]
        self.offset = mx.array([int(c.offset) for c in caches], dtype=mx.int32)


def load_model(name: str, workdir: Path) -> Runtime:
    if name == "demo":
        return load_demo()
    _, model_dir = build(name, workdir, None)
    return load(model_dir)


def work(a: Any, canvas: int, cache_len: int, sc_top_k: int | None) -> float:
    """FLOPs of one self-conditioned step of one sequence (its cache's filled slots, not the
    padding): the bench's FLOP model, whose full-vocabulary self-conditioning product only
    counts where the precision runs it (``sc_top_k`` None)."""
    sc_mlp = 2 * canvas * 3 * a.hidden_size * a.intermediate_size
    return step_flops(a, canvas, cache_len, sc=sc_top_k is None) + (0 if sc_top_k is None else sc_mlp)


def uptime() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(name: str, rt: Runtime, batches: list[int], reps: int, log: Callable[[str], None]) -> list[dict]:
    model = rt.model
    a = model.args
    C, V = a.canvas_length, a.vocab_size
    params = SamplerParams.from_config(rt.generation_config, max_denoising_steps=8)
    serial_step = rt.step(params)  # what every answer runs
    batched_step = StepFunction(model, params, rt.activation_dtype,  # its own traces for the stacked shapes
                                precision_sc_top_k=rt.precision.sc_top_k)
    rng = np.random.default_rng(0)
    caches: dict[int, KVCache] = {}

    def cache_for(n: int) -> KVCache:
        if n not in caches:
            c = model.make_cache()
            model.prefill(mx.array(rng.integers(0, V, (1, n)), dtype=mx.int32), c)
            caches[n] = c
        return caches[n]

    rows = []
    for B in batches:
        lo, hi = PROMPTS[name]
        lengths = [int(x) for x in np.linspace(lo, hi, B).round()] if B > 1 else [lo]
        log(f"{name} B={B}: prefilling prompts of {lengths} tokens")
        cs = [cache_for(n) for n in lengths]
        # every sequence one step in, so the measured steps take the self-conditioning path
        seqs = []
        for i, c in enumerate(cs):
            canvas = mx.array(rng.integers(0, V, (1, C)), dtype=mx.int32)
            out = serial_step(canvas, None, 0.2, mx.random.key(i), serial_step.initial_history((1, C)), c)
            mx.eval(*out.values())
            seqs.append((out["canvas"], out["processed"], out["history"], mx.random.key(100 + i)))

        def serial() -> None:
            for (canvas, sc, hist, key), c in zip(seqs, cs):
                out = serial_step(canvas, sc, 0.2, key, hist, c)
                mx.eval(*out.values())
                out["finite"].item()

        t0 = time.perf_counter()
        stacked = StackedCache(cs)
        mx.eval(stacked.state())
        stack_s = time.perf_counter() - t0
        canvas_b = mx.concatenate([s[0] for s in seqs])
        sc_b = mx.concatenate([s[1] for s in seqs])
        hist_b = mx.concatenate([s[2] for s in seqs], axis=1)  # [k, B, C]

        def batched() -> None:
            out = batched_step(canvas_b, sc_b, 0.2, mx.random.key(7), hist_b, stacked)
            mx.eval(*out.values())
            out["finite"].item()

        # the batch is a real one: each sequence's logits as when it runs alone
        dtype = model.activation_dtype
        alone = [model.denoise(s[0], c, s[1], dtype=dtype, sc_top_k=serial_step.sc_top_k) for s, c in zip(seqs, cs)]
        together = model.denoise(canvas_b, stacked, sc_b, dtype=dtype, sc_top_k=serial_step.sc_top_k)
        mx.eval(together, *alone)
        scale = max(float(mx.abs(x).max()) for x in alone)
        err = max(float(mx.abs(together[i:i + 1] - x).max()) for i, x in enumerate(alone)) / scale
        argmax_same = float(np.mean([np.array(mx.argmax(together[i:i + 1], -1) == mx.argmax(x, -1)).mean()
                                     for i, x in enumerate(alone)]))

        serial(), batched()  # warm-up: traces and kernels
        load_before = uptime()
        ceiling = dense_matmul_gflops(dtype)  # the machine's dense matmul rate right now
        ts: dict[str, list[float]] = {"serial": [], "batched": []}
        for r in range(reps):
            for kind, fn in (("serial", serial), ("batched", batched)) if r % 2 == 0 else \
                    (("batched", batched), ("serial", serial)):
                t0 = time.perf_counter()
                fn()
                ts[kind].append(time.perf_counter() - t0)
        s, b = statistics.median(ts["serial"]), statistics.median(ts["batched"])
        flops = sum(work(a, C, n, serial_step.sc_top_k) for n in lengths)  # the same for both
        row = {"model": name, "canvas": C, "B": B, "prompt_lengths": lengths, "reps": reps,
               "serial_s": round(s, 4), "batched_s": round(b, 4), "speedup": round(s / b, 3),
               "serial_per_seq_s": round(s / B, 4), "batched_per_seq_s": round(b / B, 4),
               "serial_all_s": [round(x, 4) for x in ts["serial"]],
               "batched_all_s": [round(x, 4) for x in ts["batched"]],
               "gflop": round(flops / 1e9, 3), "serial_gflops": round(flops / s / 1e9, 3),
               "batched_gflops": round(flops / b / 1e9, 3), "dense_matmul_gflops": round(ceiling, 3),
               "stack_s": round(stack_s, 4), "logits_max_rel_err": err, "argmax_agreement": argmax_same,
               "load_before": load_before, "load_after": uptime()}
        log(f"{name} B={B}: serial {s:.3f} s, batched {b:.3f} s, speedup {s / b:.2f}x "
            f"(rel err {err:.1e}, load {row['load_before']} -> {row['load_after']})")
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,medium", help="comma-separated: demo, medium")
    ap.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=".bench-cache", help="where the random models are built and cached")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in PROMPTS:
            raise SystemExit(f"--models: unknown model {m!r}; expected some of {', '.join(PROMPTS)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1 or args.reps < 1:
        raise SystemExit("--batches and --reps: expected positive integers")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = {"machine": machine(), "backend": f"MLX {mx.__version__} {mx.default_device()}",
              "load_start": uptime(), "rows": []}
    for name in models:
        rt = load_model(name, Path(args.workdir))
        result["rows"] += measure(name, rt, batches, args.reps, log)
        del rt
        mx.clear_cache()
    result["load_end"] = uptime()

    print(f"batched vs serial denoising steps, {result['backend']}, {result['machine']['cpus']} CPUs, "
          f"load average {result['load_start']} -> {result['load_end']}")
    print("| model | B | serial s (B steps) | batched s (1 step of B) | speedup | per sequence: serial / batched s "
          "| GFLOP/s serial / batched / dense matmul | stacking s | logits rel. err | load before -> after |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |")
    for r in result["rows"]:
        print(f"| {r['model']} (canvas {r['canvas']}) | {r['B']} | {r['serial_s']:.3f} | {r['batched_s']:.3f} | "
              f"{r['speedup']:.2f}x | {r['serial_per_seq_s']:.3f} / {r['batched_per_seq_s']:.3f} | "
              f"{r['serial_gflops']:.2f} / {r['batched_gflops']:.2f} / {r['dense_matmul_gflops']:.2f} | "
              f"{r['stack_s']:.3f} | {r['logits_max_rel_err']:.1e} | {r['load_before']} -> {r['load_after']} |")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
