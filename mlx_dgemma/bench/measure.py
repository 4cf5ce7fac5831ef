"""The table's rows: one denoising step of ours (compiled, and eager for before/after) and of
each peer on the same random weights, with prefill throughput. Each function is one isolated
measurement (``isolate.isolated``) and returns one row."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .configs import random_inputs
from .flops import step_flops
from .timing import log, sync_time


def measure_ours(model_dir: str, prompt_len: int, warmup: int, steps: int, sc_top_k: int | None = None,
                 label: str | None = None, eager: bool = False, precision: str = "exact",
                 dtype: str | None = None) -> dict:
    """Decoder pass alone (eager), and the whole step (decoder + sampler + stop rule) eager and
    compiled. The compiled whole step is the headline figure (it is what generation runs)."""
    from mlx_dgemma import load
    from mlx_dgemma.sampler import SamplerParams
    from mlx_dgemma.step import StepFunction

    t_load = time.perf_counter()
    runtime = load(model_dir, precision=precision, dtype=dtype)
    model, prec = runtime.model, runtime.precision
    load_s = time.perf_counter() - t_load
    label = label or f"mlx-dgemma {prec.label}"
    log(f"{label}: loaded in {load_s:.1f} s")
    a = model.args
    C = a.canvas_length
    prompt, canvas = random_inputs(a, C, prompt_len)
    cache = model.make_cache()
    t0 = time.perf_counter()
    model.prefill(prompt, cache)
    prefill_s = time.perf_counter() - t0
    sc = model.denoise(canvas, cache)
    mx.eval(sc)
    log(f"{label}: eager decoder pass done")
    p = SamplerParams(sc_top_k=sc_top_k)
    key = mx.random.key(0)

    def decoder():
        return model.denoise(canvas, cache, sc, sc_top_k=sc_top_k)

    def whole(fn):
        hist = fn.initial_history((1, C))
        return lambda: list(fn(canvas, sc, 0.6, key, hist, cache).values())

    step_c = whole(StepFunction(model, p, prec.dtype, compile=True, precision_sc_top_k=prec.sc_top_k))
    t_first = time.perf_counter()
    mx.eval(step_c())  # tracing + kernel compilation (minutes on a cold CUDA backend): reported apart
    first_step_s = time.perf_counter() - t_first
    log(f"{label}: prefill {prefill_s:.1f} s, first compiled step {first_step_s:.1f} s")
    compiled = sync_time(step_c, warmup, steps)
    res: dict[str, Any] = {"impl": label, "precision": prec.name, "dtype": prec.dtype_name,
                           "seconds_per_step": statistics.median(compiled), "load_seconds": load_s,
                           "first_step_seconds": first_step_s}
    if eager:  # before/after: the same step without mx.compile, and the decoder pass alone
        res["seconds_per_step_eager"] = statistics.median(
            sync_time(whole(StepFunction(model, p, prec.dtype, compile=False, precision_sc_top_k=prec.sc_top_k)),
                      warmup, steps))
        res["seconds_decoder_only"] = statistics.median(sync_time(decoder, warmup, steps))
    return {**res,
            "prefill_tokens_per_second": prompt_len / prefill_s,
            "flops_per_step": step_flops(a, C, prompt_len, sc=True)}


def measure_mlx_vlm(gguf: Path, prompt_len: int, warmup: int, steps: int, quantized: bool) -> dict:
    """mlx-vlm's decoder pass plus its next self-conditioning (what a step of ours holds besides
    the sampler), dense float32 with the GGUF's weights or its stock 4-bit bfloat16."""
    from .peers import mlx_vlm_model_from_gguf

    dtype = mx.bfloat16 if quantized else mx.float32
    model = mlx_vlm_model_from_gguf(gguf, dtype=dtype, quantize_bits=4 if quantized else None)
    tc = model.config.text_config
    C = model.config.canvas_length
    prompt, canvas = random_inputs(tc, C, prompt_len)  # the same ids as ours
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

    dec = sync_time(decoder, warmup, steps)
    res = {"impl": "mlx-vlm 4-bit g64 (stock, bf16)" if quantized else "mlx-vlm dense f32 (same weights)",
           "seconds_per_step": statistics.median(dec), "prefill_tokens_per_second": prompt_len / prefill_s}
    return res


def measure_hf(gguf: Path, prompt_len: int, warmup: int, steps: int) -> dict:
    """The Hugging Face reference's forward pass over the canvas (torch eager, on the CPU)."""
    import torch

    from .peers import HFRunner, hf_model_from_gguf

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
