"""``mlx-dgemma bench``: seconds per denoising step, prefill tokens/s and peak memory on random
weights, with peers measured in the same run on the same weights:

* mlx-vlm's DiffusionGemma (``mlx_vlm.models.diffusion_gemma``), dense with the GGUF's
  dequantized weights, and re-quantized by its own stock recipe (4-bit, group 64);
* the Hugging Face reference in torch eager mode (context only: torch's CPU GEMM is far
  faster than MLX's CPU backend, so that ratio does not carry over to Apple silicon).

Also: our FLOP/s against MLX's own dense matmul throughput, a per-part breakdown of a step,
the MoE alternatives, sparse self-conditioning and the exact vs compact formats. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=256, num_layers=3, global_layers=(2,), num_heads=2,
                 num_kv_heads=1, num_global_kv_heads=1, head_dim=64, global_head_dim=128, sliding_window=64,
                 num_experts=8, top_k=2, moe_intermediate_size=64, vocab_size=512, canvas_length=256),
    "medium": dict(hidden_size=512, intermediate_size=768, num_layers=6, global_layers=(5,), num_heads=8,
                   num_kv_heads=4, num_global_kv_heads=4, head_dim=64, global_head_dim=128,
                   sliding_window=512, num_experts=32, top_k=4, moe_intermediate_size=256, vocab_size=8192,
                   canvas_length=256),
    # The published model's layer shapes, one sliding and one global layer.
    "real-shapes": dict(hidden_size=2816, intermediate_size=2112, num_layers=2, global_layers=(1,), num_heads=16,
                        num_kv_heads=8, num_global_kv_heads=2, head_dim=256, global_head_dim=512,
                        sliding_window=1024, num_experts=128, top_k=8, moe_intermediate_size=704,
                        vocab_size=262144, canvas_length=256),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="tiny,medium", help="comma-separated: tiny, medium, real-shapes")
    p.add_argument("--canvas", type=int, help="override the canvas length (e.g. 32 for real-shapes on a CPU)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens in the cache before the canvas")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--precisions", default="exact,fast",
                   help="runtime precisions of ours to measure, side by side (exact, fast)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype of fast (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--peers", default="mlx-vlm,mlx-vlm-q4,hf", help="comma-separated peers, or 'none'")
    p.add_argument("--extras", default="breakdown,quality,moe,sc,compact",
                   help="comma-separated extra studies: breakdown, quality, moe, sc, compact (or 'none')")
    p.add_argument("--quality-prompts", type=int, default=3,
                   help="generations (exact and fast, same seeds) compared block by block in the quality study")
    p.add_argument("--child-timeout", type=float, default=3600,
                   help="seconds one isolated measurement may take before it is reported as timed out")
    p.add_argument("--no-eager", action="store_true", help="skip the eager (uncompiled) step measurements")
    p.add_argument("--workdir", default=".bench-cache", help="where the random models are written (reused)")
    p.add_argument("--json", default="bench.json", help="write the results here")


# --------------------------------------------------------------------------------------------
# models


def build(name: str, workdir: Path, canvas: int | None) -> tuple[Path, Path]:
    """Random Q4_K_M GGUF of a config and its exact conversion (cached in ``workdir``)."""
    from .convert.converter import convert
    from .convert.synthetic import TinySpec, write_tiny_gguf

    spec = dict(CONFIGS[name])
    if canvas:
        spec["canvas_length"] = canvas
    tag = f"{name}-c{spec['canvas_length']}"
    gguf = workdir / f"{tag}.gguf"
    out = workdir / tag
    workdir.mkdir(parents=True, exist_ok=True)
    if not gguf.is_file():
        write_tiny_gguf(gguf, TinySpec(**spec, context_length=65536), types="q4_k_m", seed=0, weight_std=0.02)
    if not out.is_dir():
        convert(gguf, out)
    return gguf, out


def _sync_time(fn: Callable[[], Any], warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return times


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _child(conn, fn_name: str, kwargs: dict, timeout: float) -> None:
    import faulthandler

    # where a measurement that is about to be killed for its time is stuck (stderr)
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False)
    try:
        if ":" in fn_name:  # "module:function", e.g. from tests
            import importlib

            mod, _, name = fn_name.partition(":")
            res = getattr(importlib.import_module(mod), name)(**kwargs)
        else:
            res = globals()[fn_name](**kwargs)
        from .generation import peak_rss_bytes

        mlx_peak = int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else 0
        if isinstance(res, dict) and "impl" in res:
            res["peak_rss_bytes"] = peak_rss_bytes()
            res["mlx_peak_bytes"] = mlx_peak
        conn.send(("ok", res))
    except ImportError as e:
        conn.send(("missing", e.name))
    except MemoryError:
        conn.send(("skip", "out of memory"))
    except Exception as e:  # reported in the table, the run goes on
        conn.send(("error", f"{type(e).__name__}: {e}"))


CHILD_TIMEOUT = 3600.0


def isolated(fn_name: str, timeout: float | None = None, **kwargs) -> dict:
    """Run one measurement in a fresh process: clean peak memory, no interference.

    Polls the child: one that dies without reporting (a segfault, the OOM killer, a CUDA
    abort) is reported as such at once, and one that outlives ``timeout`` is killed, instead
    of the parent waiting for a message that never comes.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    timeout = timeout or CHILD_TIMEOUT
    proc = ctx.Process(target=_child, args=(child, fn_name, kwargs, timeout))
    proc.start()
    child.close()  # the parent's copy: EOF on the pipe once the child is gone
    deadline = time.monotonic() + timeout
    status, res = "error", "timed out"
    while time.monotonic() < deadline:
        if parent.poll(1.0):
            try:
                status, res = parent.recv()
            except EOFError:
                proc.join(5)
                status, res = "error", f"the measuring process died (exit code {proc.exitcode})"
            break
        if not proc.is_alive():
            proc.join()
            status, res = "error", f"the measuring process died (exit code {proc.exitcode})"
            break
    if proc.is_alive():
        proc.kill()
    proc.join()
    if status == "ok":
        return res
    if status == "missing":  # `missing` lets the caller report a missing peer once
        return {"impl": kwargs.get("label", fn_name), "missing": res,
                "skipped": f"not installed ({res}); install the peers with: pip install -e '.[parity,bench]'"}
    return {"impl": kwargs.get("label", fn_name), "skipped": res}


# --------------------------------------------------------------------------------------------
# FLOPs


def step_flops(a, canvas: int, cache_len: int, sc: bool = True) -> float:
    """Multiply-adds x 2 of one decoder step (projections, attention, MLPs, experts, head, SC)."""
    C, H = canvas, a.hidden_size
    total = 0.0
    for i in range(a.num_hidden_layers):
        sliding = a.is_sliding(i)
        hd = a.head_dim if sliding else a.global_head_dim
        kv = a.num_key_value_heads if sliding else a.num_global_key_value_heads
        q, k = a.num_attention_heads * hd, kv * hd
        keys = min(cache_len, a.sliding_window - 1) + C if sliding else cache_len + C
        total += 2 * C * H * (q + k * (2 if sliding else 1)) + 2 * C * q * H  # q, k, v, o
        total += 2 * 2 * C * a.num_attention_heads * keys * hd  # scores and weighted sum
        total += 2 * C * 3 * H * a.intermediate_size  # dense gated MLP
        total += 2 * C * H * a.num_experts  # router
        total += 2 * C * a.top_k_experts * 3 * H * a.moe_intermediate_size  # experts
    total += 2 * C * H * a.vocab_size  # tied output head
    if sc:
        total += 2 * C * H * a.vocab_size + 2 * C * 3 * H * a.intermediate_size  # probs @ E, SC MLP
    return total


def dense_matmul_gflops(dtype: mx.Dtype, M: int = 256, K: int = 2048, N: int = 2048) -> float:
    """MLX's own dense matmul throughput on this machine (the ceiling for our FLOP/s)."""
    x = mx.random.normal((M, K)).astype(dtype)
    w = mx.random.normal((N, K)).astype(dtype)
    t = statistics.median(_sync_time(lambda: x @ w.T, 1, 3))
    return 2 * M * K * N / t / 1e9


# --------------------------------------------------------------------------------------------
# ours


def _inputs(a, canvas: int, prompt_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(0, a.vocab_size, (1, prompt_len)), dtype=mx.int32)
    canv = mx.array(rng.integers(0, a.vocab_size, (1, canvas)), dtype=mx.int32)
    return prompt, canv


def measure_ours(model_dir: str, prompt_len: int, warmup: int, steps: int, sc_top_k: int | None = None,
                 label: str | None = None, eager: bool = False, precision: str = "exact",
                 dtype: str | None = None) -> dict:
    """Decoder pass alone (eager), and the whole step (decoder + sampler + stop rule) eager and
    compiled. The compiled whole step is the headline figure (it is what generation runs)."""
    from .loader import load
    from .sampler import SamplerParams
    from .step import StepFunction

    t_load = time.perf_counter()
    model, _ = load(model_dir, precision=precision, dtype=dtype)
    load_s = time.perf_counter() - t_load
    label = label or f"mlx-dgemma {model.precision.label}"
    _log(f"{label}: loaded in {load_s:.1f} s")
    a = model.args
    C = a.canvas_length
    prompt, canvas = _inputs(a, C, prompt_len)
    cache = model.make_cache()
    t0 = time.perf_counter()
    model.prefill(prompt, cache)
    prefill_s = time.perf_counter() - t0
    sc = model.denoise(canvas, cache)
    mx.eval(sc)
    _log(f"{label}: eager decoder pass done")
    p = SamplerParams(sc_top_k=sc_top_k)
    key = mx.random.key(0)

    def decoder():
        return model.denoise(canvas, cache, sc, sc_top_k=sc_top_k)

    def whole(fn):
        hist = fn.initial_history((1, C))
        return lambda: list(fn(canvas, sc, 0.6, key, hist, cache).values())

    step_c = whole(StepFunction(model, p, compile=True))
    t_first = time.perf_counter()
    mx.eval(step_c())  # tracing + kernel compilation (minutes on a cold CUDA backend): reported apart
    first_step_s = time.perf_counter() - t_first
    _log(f"{label}: prefill {prefill_s:.1f} s, first compiled step {first_step_s:.1f} s")
    compiled = _sync_time(step_c, warmup, steps)
    res: dict[str, Any] = {"impl": label, "precision": model.precision.name, "dtype": model.precision.dtype_name,
                           "seconds_per_step": statistics.median(compiled), "load_seconds": load_s,
                           "first_step_seconds": first_step_s}
    if eager:  # before/after: the same step without mx.compile, and the decoder pass alone
        res["seconds_per_step_eager"] = statistics.median(
            _sync_time(whole(StepFunction(model, p, compile=False)), warmup, steps))
        res["seconds_decoder_only"] = statistics.median(_sync_time(decoder, warmup, steps))
    return {**res,
            "prefill_tokens_per_second": prompt_len / prefill_s,
            "flops_per_step": step_flops(a, C, prompt_len, sc=True)}


# --------------------------------------------------------------------------------------------
# peers


def measure_mlx_vlm(gguf: Path, prompt_len: int, warmup: int, steps: int, quantized: bool) -> dict:
    from .reference import mlx_vlm_model_from_gguf

    dtype = mx.bfloat16 if quantized else mx.float32
    model = mlx_vlm_model_from_gguf(gguf, dtype=dtype, quantize_bits=4 if quantized else None)
    tc = model.config.text_config
    C = model.config.canvas_length
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, tc.vocab_size, (1, prompt_len)), dtype=mx.int32)
    canvas = mx.array(rng.integers(0, tc.vocab_size, (1, C)), dtype=mx.int32)
    cache = model.make_cache()
    t0 = time.perf_counter()
    model.diffusion_prefill_cache(prompt, cache=cache)
    mx.eval([c.state for c in cache if hasattr(c, "state")] if isinstance(cache, list) else [])
    prefill_s = time.perf_counter() - t0
    logits = model.diffusion_decoder_logits(canvas, cache=cache)
    mx.eval(logits)
    emb = model.diffusion_prepare_self_conditioning()
    sc = model.diffusion_self_conditioning(logits, emb)
    mx.eval(sc)

    def decoder():
        lg = model.diffusion_decoder_logits(canvas, cache=cache, self_conditioning=sc)
        # the next step's self-conditioning is part of a step, as in ours
        return model.diffusion_self_conditioning(lg, emb) if emb is not None else lg

    dec = _sync_time(decoder, warmup, steps)
    res = {"impl": "mlx-vlm 4-bit g64 (stock, bf16)" if quantized else "mlx-vlm dense f32 (same weights)",
           "seconds_per_step": statistics.median(dec), "prefill_tokens_per_second": prompt_len / prefill_s}
    return res


def measure_hf(gguf: Path, prompt_len: int, warmup: int, steps: int) -> dict:
    import torch

    from .reference import HFRunner, hf_model_from_gguf

    model = hf_model_from_gguf(gguf, attn_implementation="eager")
    run = HFRunner(model)
    cfg = model.config.text_config
    C = model.config.canvas_length
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (1, prompt_len))
    canvas = rng.integers(0, cfg.vocab_size, (1, C))
    t0 = time.perf_counter()
    run.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    sc = run.denoise(canvas)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        run.denoise(canvas, sc)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"impl": f"HF transformers eager (torch {torch.__version__})", "seconds_per_step": statistics.median(times),
            "prefill_tokens_per_second": prompt_len / prefill_s}


# --------------------------------------------------------------------------------------------
# studies


def breakdown(model_dir: Path, prompt_len: int, steps: int, precision: str = "exact",
              dtype: str | None = None) -> dict[str, float]:
    """Seconds of each part of a step, each timed alone with the step's shapes."""
    from .loader import load
    from .sampler import sample_step

    model, _ = load(model_dir, precision=precision, dtype=dtype)
    a = model.args
    dt = model.activation_dtype
    C = a.canvas_length
    prompt, canvas = _inputs(a, C, prompt_len)
    cache = model.make_cache()
    model.prefill(prompt, cache)
    h = (mx.random.normal((1, C, a.hidden_size)) * 0.5).astype(dt)
    logits = model.denoise(canvas, cache)
    mx.eval(h, logits)
    parts: dict[str, float] = {"attention": 0.0, "dense MLP": 0.0, "router + MoE": 0.0}
    offset = cache.offset
    for i, layer in enumerate(model.layers):
        freqs = None if layer.self_attn.sliding else model._global_freqs()
        x = layer.input_layernorm(h)
        parts["attention"] += statistics.median(_sync_time(
            lambda: layer.self_attn(x, cache[i], offset, False, freqs), 1, steps))
        parts["dense MLP"] += statistics.median(_sync_time(lambda: layer.mlp(x), 1, steps))

        def moe():
            idx, w = layer.router(h)
            return layer.experts(layer.pre_feedforward_layernorm_2(h), idx, w)

        parts["router + MoE"] += statistics.median(_sync_time(moe, 1, steps))
    parts["output head"] = statistics.median(_sync_time(lambda: model.logits(h), 1, steps))
    parts["self-conditioning"] = statistics.median(_sync_time(
        lambda: model.self_conditioning(h, model.soft_embeddings(logits, dt)), 1, steps))
    parts["sampler"] = statistics.median(_sync_time(
        lambda: list(sample_step(logits, 0.6, 0.1, a.vocab_size, mx.random.key(0)).values()), 1, steps))
    return parts


def quality(model_dir: Path, prompt_len: int, dtype: str | None = None, prompts: int = 3,
            gen_steps: int = 12) -> dict[str, Any]:
    """fast vs exact on the same weights and inputs: per-step logit error and top-1 agreement
    (step 1 without and a step with self-conditioning), and over whole generations with the
    same seed, the share of blocks where both commit the same tokens."""
    from .loader import load

    exact, tok = load(model_dir, precision="exact")
    fast, _ = load(model_dir, precision="fast", dtype=dtype)
    return {"fast": fast.precision.label, **logit_agreement(exact, fast, prompt_len),
            **block_agreement(exact, fast, tok, prompts, gen_steps)}


def logit_agreement(exact, fast, prompt_len: int, seed: int = 0) -> dict[str, float]:
    """Max relative logit error and top-1 agreement of ``fast`` against ``exact``."""
    a = exact.args
    prompt, canvas = _inputs(a, a.canvas_length, prompt_len, seed)
    out: dict[str, float] = {}
    ce, cf = exact.make_cache(), fast.make_cache()
    exact.prefill(prompt, ce)
    fast.prefill(prompt, cf)
    e1, f1 = exact.denoise(canvas, ce), fast.denoise(canvas, cf)
    sc = e1 / 0.6  # the next step's self-conditioning input, the same for both
    e2, f2 = exact.denoise(canvas, ce, sc), fast.denoise(canvas, cf, sc)
    for name, e, f in (("step", e1, f1), ("sc_step", e2, f2)):
        e, f = np.array(e.astype(mx.float32)), np.array(f.astype(mx.float32))
        out[f"{name}_max_rel_logit_error"] = float(np.abs(f - e).max() / np.abs(e).max())
        out[f"{name}_top1_agreement"] = float((f.argmax(-1) == e.argmax(-1)).mean())
    return out


def block_agreement(exact, fast, tokenizer, prompts: int = 3, gen_steps: int = 12) -> dict[str, Any]:
    """Whole generations, same seeds: share of committed blocks identical in both, and of
    token positions equal within the compared blocks (up to the first block that differs:
    after it the two answers are conditioned on different text)."""
    from .generation import BlockEvent, stream_generate

    texts = ["Why is the sky blue?", "Write a short poem about rivers.", "List three prime numbers.",
             "What is diffusion?", "Tell me about the moon."][:prompts]
    same = total = same_tok = total_tok = 0
    for i, text in enumerate(texts):
        blocks = []
        for m in (exact, fast):
            evs = stream_generate(m, tokenizer, text, generation_config=getattr(m, "generation_config", None),
                                  seed=i, max_denoising_steps=gen_steps, max_new_tokens=2 * m.args.canvas_length)
            blocks.append([ev.tokens for ev in evs if isinstance(ev, BlockEvent)])
        for be, bf in zip(*blocks):
            total += 1
            same += be == bf
            total_tok += len(be)
            same_tok += sum(a == b for a, b in zip(be, bf))
            if be != bf:
                break
    return {"blocks_compared": total, "blocks_identical": same,
            "block_agreement": same / total if total else float("nan"),
            "token_agreement": same_tok / total_tok if total_tok else float("nan")}


def moe_alternatives(model_dir: Path, steps: int) -> dict[str, float]:
    """One layer's experts on a canvas of tokens: sorted gather_qmm (ours), unsorted, per-expert."""
    from .loader import load
    from .model import _gelu

    model, _ = load(model_dir, precision="exact")
    a = model.args
    C = a.canvas_length
    layer = model.layers[0]
    h = mx.random.normal((1, C, a.hidden_size)) * 0.5
    idx, w = layer.router(h)
    x = layer.pre_feedforward_layernorm_2(h)
    mx.eval(idx, w, x)
    ex = layer.experts
    out = {"gather_qmm sorted (ours)": statistics.median(_sync_time(lambda: ex(x, idx, w), 1, steps))}

    def unsorted():
        xs = mx.expand_dims(x.reshape(-1, a.hidden_size), (-2, -3))
        ids = idx.reshape(-1, a.top_k_experts)
        gu = ex.gate_up_proj(xs, ids)
        y = ex.down_proj(_gelu(gu[..., : ex.inter]) * gu[..., ex.inter:], ids).squeeze(-2)
        return (y * w.reshape(-1, a.top_k_experts, 1)).sum(-2)

    out["gather_qmm unsorted"] = statistics.median(_sync_time(unsorted, 1, steps))

    def per_expert():
        flat = x.reshape(-1, a.hidden_size)
        ids = np.array(idx.reshape(-1, a.top_k_experts))
        ww = w.reshape(-1, a.top_k_experts)
        y = mx.zeros_like(flat)
        gu_w, dn = ex.gate_up_proj, ex.down_proj
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)
            xe = flat[mx.array(tok)]
            g = mx.quantized_matmul(xe, gu_w["weight"][int(e)], gu_w["scales"][int(e)], gu_w["biases"][int(e)],
                                    transpose=True, group_size=32, bits=gu_w.bits)
            act = _gelu(g[..., : ex.inter]) * g[..., ex.inter:]
            d = mx.quantized_matmul(act, dn["weight"][int(e)], dn["scales"][int(e)], dn["biases"][int(e)],
                                    transpose=True, group_size=32, bits=dn.bits)
            y = y.at[mx.array(tok)].add(d * ww[mx.array(tok), mx.array(slot)][:, None])
        return y

    if hasattr(ex.gate_up_proj, "bits"):
        out["per-expert quantized_matmul"] = statistics.median(_sync_time(per_expert, 1, steps))
    return out


def sc_top_k_study(model_dir: Path, prompt_len: int, steps: int, ks=(64, 16)) -> list[dict]:
    from .loader import load

    model, _ = load(model_dir, precision="exact")
    a = model.args
    prompt, canvas = _inputs(a, a.canvas_length, prompt_len)
    cache = model.make_cache()
    model.prefill(prompt, cache)
    sc = model.denoise(canvas, cache) / 0.6
    mx.eval(sc)
    exact = model.denoise(canvas, cache, sc)
    t_exact = statistics.median(_sync_time(lambda: model.soft_embeddings(sc, mx.float32), 1, steps))
    rows = [{"sc_top_k": None, "soft_embedding_seconds": t_exact, "max_rel_logit_error": 0.0}]
    for k in ks:
        approx = model.denoise(canvas, cache, sc, sc_top_k=k)
        err = float(mx.abs(approx - exact).max() / mx.abs(exact).max())
        t = statistics.median(_sync_time(lambda: model.soft_embeddings(sc, mx.float32, top_k=k), 1, steps))
        rows.append({"sc_top_k": k, "soft_embedding_seconds": t, "max_rel_logit_error": err})
    return rows


def compact_study(gguf: Path, model_dir: Path, prompt_len: int, warmup: int, steps: int) -> dict:
    from .convert.converter import convert

    compact_dir = model_dir.with_name(model_dir.name + "-compact")
    if not compact_dir.is_dir():
        convert(gguf, compact_dir, compact=True)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    exact = isolated("measure_ours", model_dir=str(model_dir), prompt_len=prompt_len, warmup=warmup, steps=steps,
                     label="exact")
    compact = isolated("measure_ours", model_dir=str(compact_dir), prompt_len=prompt_len, warmup=warmup,
                       steps=steps, label="compact")
    return {fmt: {"bytes": size(d), "seconds_per_step": r.get("seconds_per_step"),
                  "peak_rss_bytes": r.get("peak_rss_bytes")}
            for fmt, d, r in (("exact", model_dir, exact), ("compact", compact_dir, compact))}


# --------------------------------------------------------------------------------------------


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "mlx": mx.__version__, "device": str(mx.default_device())}
    try:
        import os

        info["cpus"] = os.cpu_count()
    except Exception:  # pragma: no cover
        pass
    return info


def run(args: argparse.Namespace) -> dict:
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        from .errors import ParameterError

        raise ParameterError(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    peers = [] if args.peers == "none" else [p.strip() for p in args.peers.split(",")]
    extras = [] if args.extras == "none" else [e.strip() for e in args.extras.split(",")]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or any(p not in ("exact", "fast") for p in precisions):
        from .errors import ParameterError

        raise ParameterError(f"--precisions: {args.precisions!r}; give a comma-separated list of exact, fast")
    work = Path(args.workdir)
    result: dict[str, Any] = {"machine": machine(), "dense_matmul_gflops": {}, "configs": {}}
    for dt_name, dt in (("float32", mx.float32), ("bfloat16", mx.bfloat16)):
        result["dense_matmul_gflops"][dt_name] = dense_matmul_gflops(dt)
    for name in names:
        print(f"[bench] {name}: building the random model", file=sys.stderr)
        gguf, model_dir = build(name, work, args.canvas)
        entry: dict[str, Any] = {"rows": []}
        ours_rows = []
        for prec in precisions:
            print(f"[bench] {name}: mlx-dgemma {prec}", file=sys.stderr)
            ours = isolated("measure_ours", timeout=args.child_timeout, model_dir=str(model_dir),
                            prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps,
                            eager=not args.no_eager, precision=prec, dtype=args.dtype, label=None)
            if "skipped" in ours:  # reported in the table; the peers are still measured
                ours["impl"] = f"mlx-dgemma {prec}"
                entry["rows"].append(ours)
                continue
            ours["achieved_gflops"] = ours["flops_per_step"] / ours["seconds_per_step"] / 1e9
            dense = result["dense_matmul_gflops"].get(ours["dtype"], result["dense_matmul_gflops"]["float32"])
            ours["fraction_of_dense_matmul"] = ours["achieved_gflops"] / dense
            ours["vs"] = {}
            entry["rows"].append(ours)
            ours_rows.append(ours)
        missing: set[str] = set()  # peer packages found missing: one line each, not one per peer
        for peer in peers:
            common = dict(gguf=str(gguf), prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps)
            if peer in ("mlx-vlm", "mlx-vlm-q4"):
                if "mlx_vlm" in missing:
                    continue
                print(f"[bench] {name}: {peer}", file=sys.stderr)
                row = isolated("measure_mlx_vlm", timeout=args.child_timeout, quantized=peer == "mlx-vlm-q4",
                               **common)
            elif peer == "hf":
                print(f"[bench] {name}: {peer}", file=sys.stderr)
                row = isolated("measure_hf", timeout=args.child_timeout, **common)
            else:
                from .errors import ParameterError

                raise ParameterError(f"--peers: unknown peer {peer!r}; choose from mlx-vlm, mlx-vlm-q4, hf")
            if "missing" in row:
                missing.add(row.pop("missing"))
                row["impl"] = "mlx-vlm" if peer.startswith("mlx-vlm") else "transformers"
            if "seconds_per_step" in row:
                for ours in ours_rows:
                    ours["vs"][row["impl"]] = ours["seconds_per_step"] / row["seconds_per_step"]
            entry["rows"].append(row)
            gc.collect()
        if "breakdown" in extras:
            entry["breakdown"] = {prec: isolated("breakdown", timeout=args.child_timeout, model_dir=str(model_dir),
                                                 prompt_len=args.prompt_len, steps=args.steps, precision=prec,
                                                 dtype=args.dtype)
                                  for prec in precisions}
        if "quality" in extras:
            entry["quality"] = isolated("quality", timeout=args.child_timeout, model_dir=str(model_dir),
                                        prompt_len=args.prompt_len, dtype=args.dtype, prompts=args.quality_prompts)
        if "moe" in extras:
            entry["moe"] = isolated("moe_alternatives", model_dir=str(model_dir), steps=args.steps)
        if "sc" in extras:
            entry["sc_top_k"] = isolated("sc_top_k_study", model_dir=str(model_dir), prompt_len=args.prompt_len,
                                         steps=args.steps)
        if "compact" in extras:
            entry["formats"] = compact_study(gguf, model_dir, args.prompt_len, args.warmup, args.steps)
        result["configs"][f"{name} (canvas {json.loads((model_dir / 'config.json').read_text())['canvas_length']})"] = entry
    return result


def table(result: dict) -> str:
    lines = [f"machine: {result['machine']['platform']} ({result['machine']['device']}, mlx {result['machine']['mlx']})",
             "MLX dense matmul: " + ", ".join(f"{k} {v:.2f} GFLOP/s" for k, v in result["dense_matmul_gflops"].items())]
    for name, entry in result["configs"].items():
        lines += ["", f"## {name}",
                  f"{'implementation':<36} {'ms/step':>9} {'prefill tok/s':>13} {'peak RSS GB':>11} {'MLX peak GB':>11}"]
        for r in entry["rows"]:
            if "skipped" in r:
                lines.append(f"{r['impl']:<36} skipped: {r['skipped']}")
                continue
            peak = f"{r['peak_rss_bytes'] / 1e9:.2f}" if r.get("peak_rss_bytes") else "-"
            mpeak = f"{r['mlx_peak_bytes'] / 1e9:.2f}" if r.get("mlx_peak_bytes") else "-"
            lines.append(f"{r['impl']:<36} {r['seconds_per_step'] * 1e3:>9.1f} "
                         f"{r['prefill_tokens_per_second']:>13.1f} {peak:>11} {mpeak:>11}")
        for ours in (r for r in entry["rows"] if "vs" in r):
            if ours["vs"]:
                lines.append(f"{ours['impl']}: " + ", ".join(f"{v:.2f}x {k}" for k, v in ours["vs"].items()))
            lines.append(f"  {ours['flops_per_step'] / 1e9:.1f} GFLOP/step -> {ours['achieved_gflops']:.1f} GFLOP/s = "
                         f"{ours['fraction_of_dense_matmul']:.0%} of MLX dense {ours['dtype']} matmul; load "
                         f"{ours['load_seconds']:.1f} s, first step {ours['first_step_seconds']:.1f} s")
            if "seconds_per_step_eager" in ours:
                lines.append(f"  step: compiled {ours['seconds_per_step'] * 1e3:.1f} ms, eager "
                             f"{ours['seconds_per_step_eager'] * 1e3:.1f} ms "
                             f"(decoder pass alone {ours['seconds_decoder_only'] * 1e3:.1f} ms)")
        q = entry.get("quality")
        if q and "skipped" not in q:
            lines.append(f"quality, {q['fast']} vs exact: max rel logit error {q['step_max_rel_logit_error']:.2e} "
                         f"(step 1), {q['sc_step_max_rel_logit_error']:.2e} (self-conditioned); top-1 agreement "
                         f"{q['step_top1_agreement']:.1%} / {q['sc_step_top1_agreement']:.1%}; identical blocks "
                         f"{q['blocks_identical']}/{q['blocks_compared']}")
        elif q:
            lines.append(f"quality: skipped ({q['skipped']})")
        for study in ("moe", "sc_top_k"):
            if isinstance(entry.get(study), dict) and "skipped" in entry[study]:
                lines.append(f"{study}: skipped ({entry.pop(study)['skipped']})")
        for prec, parts in entry.get("breakdown", {}).items():
            if "skipped" in parts:
                lines.append(f"breakdown ({prec}): skipped ({parts['skipped']})")
                continue
            lines.append(f"breakdown ({prec}, ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
        if "moe" in entry:
            lines.append("MoE (one layer): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in entry["moe"].items()))
        if "sc_top_k" in entry:
            lines.append("self-conditioning: " + ", ".join(
                f"{'exact' if r['sc_top_k'] is None else 'top-' + str(r['sc_top_k'])} "
                f"{r['soft_embedding_seconds'] * 1e3:.1f} ms (err {r['max_rel_logit_error']:.1e})"
                for r in entry["sc_top_k"]))
        if "formats" in entry:
            f = entry["formats"]
            lines.append(f"formats: exact {f['exact']['bytes'] / 1e6:.1f} MB {f['exact']['seconds_per_step']:.3f} s/step; "
                         f"compact {f['compact']['bytes'] / 1e6:.1f} MB {f['compact']['seconds_per_step']:.3f} s/step")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(table(result))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0
