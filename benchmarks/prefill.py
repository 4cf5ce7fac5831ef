"""Prefill benchmark: tokens/s and peak memory against the prompt length, ours vs mlx-vlm.

Every measurement runs in a fresh process (clean peak memory, no shared buffer cache). The
models are ``mlx_dgemma.bench``'s random configs (``build()``); mlx-vlm holds the same
weights dequantized (float32) and prefills with its own chunking (``chunk_prefill``, its
default step of 2048 tokens). Prints a table and writes JSON.

    python benchmarks/prefill.py --config medium --lengths 1024,4096,16384,32768
    python benchmarks/prefill.py --config medium --lengths 4096 --chunks 256,512,1024,2048 --impls ours
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MLX_VLM_STEP = 2048  # mlx_vlm.generate.common.DEFAULT_PREFILL_STEP_SIZE


def _rss() -> int:
    from mlx_dgemma.memory import current_rss_bytes

    return current_rss_bytes()


def _prompt(vocab: int, n: int):
    import mlx.core as mx
    import numpy as np

    return mx.array(np.random.default_rng(0).integers(0, vocab, (1, n)), dtype=mx.int32)


def measure_ours(model_dir: str, n: int, chunk: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dgemma import load
    from mlx_dgemma.memory import estimate_prefill

    model = load(model_dir).model
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = _prompt(model.args.vocab_size, n)
    model.prefill(prompt[:, :64], model.make_cache(), chunk_size=chunk)  # warm-up
    est = estimate_prefill(model.args, n, chunk_size=chunk)
    mx.clear_cache()
    mx.reset_peak_memory()
    rss0 = _rss()
    cache = model.make_cache()
    t0 = time.perf_counter()
    model.prefill(prompt, cache, chunk_size=chunk)
    seconds = time.perf_counter() - t0
    return {"impl": f"mlx-dgemma (chunk {chunk})", "tokens": n, "seconds": seconds,
            "tokens_per_second": n / seconds, "peak_bytes": int(mx.get_peak_memory()),
            "kv_bytes": cache.nbytes, "weights_bytes": weights, "rss_growth_bytes": _rss() - rss0,
            "estimated_kv_bytes": est.kv_bytes, "estimated_working_bytes": est.working_bytes}


def measure_mlx_vlm(gguf: str, n: int, step: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dgemma.bench.peers import mlx_vlm_model_from_gguf

    model = mlx_vlm_model_from_gguf(Path(gguf), dtype=mx.float32)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = _prompt(model.config.text_config.vocab_size, n)

    def run(ids):
        cache = model.make_cache()
        model.diffusion_prefill_cache(ids, cache=cache, prefill_step_size=step, chunk_prefill=ids.shape[1] > step)
        mx.eval([c.state for c in cache])
        return cache

    run(prompt[:, :64])  # warm-up
    mx.clear_cache()
    mx.reset_peak_memory()
    rss0 = _rss()
    t0 = time.perf_counter()
    cache = run(prompt)
    seconds = time.perf_counter() - t0
    kv = sum(a.nbytes for c in cache for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
             if hasattr(a, "nbytes"))
    return {"impl": f"mlx-vlm f32 (step {step})", "tokens": n, "seconds": seconds, "tokens_per_second": n / seconds,
            "peak_bytes": int(mx.get_peak_memory()), "kv_bytes": kv, "weights_bytes": weights,
            "rss_growth_bytes": _rss() - rss0}


def _random_kv(shape: tuple[int, ...], seed: int):
    import mlx.core as mx

    return mx.random.normal(shape, key=mx.random.key(seed)) * 0.5


def sample_ours(model_dir: str, depth: int, n: int, chunk: int) -> dict:
    """The last ``n`` tokens of a ``depth + n`` prompt: the cache is filled to ``depth`` with
    random keys and values (same shapes and slots as a real prefill), then ``n`` real tokens
    are prefilled. The peak is the full prompt's (its last chunks hold the largest cache and
    scores); the rate is the one at that depth."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dgemma import load

    model = load(model_dir).model
    a = model.args
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = _prompt(a.vocab_size, n)
    model.prefill(prompt[:, :64], model.make_cache(), chunk_size=chunk)  # warm-up
    cache = model.make_cache()
    cache.reserve(depth + n)
    for i, layer in enumerate(cache.layers):
        kv = a.num_key_value_heads if layer.sliding else a.num_global_key_value_heads
        d = a.head_dim if layer.sliding else a.global_head_dim
        keep = min(depth, a.sliding_window - 1) if layer.sliding else depth
        # an encoder write of the last `keep` positions (what a real prefill leaves cached)
        layer.attend(_random_kv((1, kv, keep, d), 2 * i), _random_kv((1, kv, keep, d), 2 * i + 1), depth - keep,
                     encode=True)
        layer.count = depth
    cache.offset = depth
    mx.eval(cache.state())
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    model.prefill(prompt, cache, chunk_size=chunk)
    seconds = time.perf_counter() - t0
    return {"impl": f"mlx-dgemma (chunk {chunk})", "tokens": depth + n, "sampled": n, "seconds": seconds,
            "tokens_per_second": n / seconds, "peak_bytes": int(mx.get_peak_memory()), "kv_bytes": cache.nbytes,
            "weights_bytes": weights}


def sample_mlx_vlm(gguf: str, depth: int, n: int, step: int) -> dict:
    """As :func:`sample_ours`, for mlx-vlm's caches (KVCache, RotatingKVCache)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dgemma.bench.peers import mlx_vlm_model_from_gguf

    model = mlx_vlm_model_from_gguf(Path(gguf), dtype=mx.float32)
    tc = model.config.text_config
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = _prompt(tc.vocab_size, n)

    def run(ids, cache):
        model.diffusion_prefill_cache(ids, cache=cache, prefill_step_size=step, chunk_prefill=ids.shape[1] > step)
        mx.eval([c.state for c in cache])

    run(prompt[:, :64], model.make_cache())  # warm-up
    cache = model.make_cache()
    for i, (c, kind) in enumerate(zip(cache, tc.layer_types)):
        sliding = kind != "full_attention"
        kv = tc.num_key_value_heads if sliding else tc.num_global_key_value_heads
        d = tc.head_dim if sliding else tc.global_head_dim
        keep = min(depth, tc.sliding_window) if sliding else depth
        c.update_and_fetch(_random_kv((1, kv, keep, d), 2 * i), _random_kv((1, kv, keep, d), 2 * i + 1))
        c.offset = depth
    mx.eval([c.state for c in cache])
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    run(prompt, cache)
    seconds = time.perf_counter() - t0
    kv = sum(a.nbytes for c in cache for a in c.state)
    return {"impl": f"mlx-vlm f32 (step {step})", "tokens": depth + n, "sampled": n, "seconds": seconds,
            "tokens_per_second": n / seconds, "peak_bytes": int(mx.get_peak_memory()), "kv_bytes": kv,
            "weights_bytes": weights}


MEASURES = {"ours": measure_ours, "mlx-vlm": measure_mlx_vlm, "sample-ours": sample_ours,
            "sample-mlx-vlm": sample_mlx_vlm}


def isolated(kind: str, **kwargs) -> dict:
    """One measurement in a fresh interpreter (this file with --child)."""
    cmd = [sys.executable, __file__, "--child", json.dumps({"kind": kind, **kwargs})]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"impl": kind, "tokens": kwargs.get("n"), "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f}"


def table(rows: list[dict]) -> str:
    head = f"{'impl':<28} {'tokens':>7} {'timed':>6} {'tok/s':>8} {'seconds':>8} {'peak MB':>8} {'KV MB':>7} " \
           f"{'weights MB':>10} {'peak/(KV+W)':>11}"
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['impl']:<28} {r['tokens']:>7} {r['error']}")
            continue
        ratio = r["peak_bytes"] / (r["kv_bytes"] + r["weights_bytes"])
        out.append(f"{r['impl']:<28} {r['tokens']:>7} {r.get('sampled', r['tokens']):>6} "
                   f"{r['tokens_per_second']:>8.1f} {r['seconds']:>8.1f} "
                   f"{_mb(r['peak_bytes']):>8} {_mb(r['kv_bytes']):>7} {_mb(r['weights_bytes']):>10} {ratio:>11.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="medium", help="a config of mlx_dgemma.bench.CONFIGS")
    p.add_argument("--lengths", default="1024,4096,16384,32768", help="comma-separated prompt lengths")
    p.add_argument("--chunks", default="", help="comma-separated chunk sizes for ours (default: the model's default)")
    p.add_argument("--impls", default="ours,mlx-vlm", help="ours, mlx-vlm")
    p.add_argument("--sample", type=int, default=0,
                   help="time only the last N tokens of each length over a cache pre-filled with random keys "
                        "(peak memory of the whole prompt, rate at that depth; for lengths too slow to run whole)")
    p.add_argument("--workdir", default=".bench-cache")
    p.add_argument("--json", default="prefill-bench.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        kind = spec.pop("kind")
        res = MEASURES[kind](**spec)
        print(json.dumps(res))
        return 0

    from mlx_dgemma.bench import build
    from mlx_dgemma.model import DEFAULT_PREFILL_CHUNK

    gguf, model_dir = build(a.config, Path(a.workdir), None)
    chunks = [int(c) for c in a.chunks.split(",") if c] or [DEFAULT_PREFILL_CHUNK]
    impls = [i.strip() for i in a.impls.split(",")]
    rows = []
    for n in [int(x) for x in a.lengths.split(",")]:
        sample = {"depth": n - a.sample, "n": a.sample} if a.sample else {"n": n}
        pre = "sample-" if a.sample else ""
        if "ours" in impls:
            for c in chunks:
                rows.append(isolated(pre + "ours", model_dir=str(model_dir), chunk=c, **sample))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        if "mlx-vlm" in impls:
            rows.append(isolated(pre + "mlx-vlm", gguf=str(gguf), step=MLX_VLM_STEP, **sample))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    import mlx.core as mx

    backend = "GPU" if mx.default_device() == mx.gpu else "CPU"
    print(f"\nprefill, config {a.config}, MLX {mx.__version__} backend {backend}")
    print(table(rows))
    Path(a.json).write_text(json.dumps({"config": a.config, "mlx": mx.__version__,
                                        "device": str(mx.default_device()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
