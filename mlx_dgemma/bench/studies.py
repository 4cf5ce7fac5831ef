"""Studies beyond the table, each answering one question about a step:

* ``breakdown``: where a step's time goes (attention, dense MLP, router + MoE, head, SC, sampler);
* ``quality``: how far ``fast`` is from ``exact`` (logits of one step, then whole generations);
* ``moe_alternatives``: the sorted ``gather_qmm`` we run against unsorted and per-expert matmuls;
* ``sc_top_k_study``: self-conditioning from each position's top-k tokens, time against error;
* ``compact_study``: the exact and compact converted formats, size against speed.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .configs import random_inputs
from .isolate import isolated
from .timing import sync_time


def breakdown(model_dir: Path, prompt_len: int, steps: int, precision: str = "exact",
              dtype: str | None = None) -> dict[str, float]:
    """Seconds of each part of a step, each timed alone with the step's shapes."""
    from mlx_dgemma import load
    from mlx_dgemma.sampler import sample_step

    runtime = load(model_dir, precision=precision, dtype=dtype)
    model = runtime.model
    a = model.args
    dt = runtime.activation_dtype
    C = a.canvas_length
    prompt, canvas = random_inputs(a, C, prompt_len)
    cache = model.make_cache()
    model.prefill(prompt, cache)
    h = (mx.random.normal((1, C, a.hidden_size)) * 0.5).astype(dt)
    logits = model.denoise(canvas, cache)
    mx.eval(h, logits)
    parts: dict[str, float] = {"attention": 0.0, "dense MLP": 0.0, "router + MoE": 0.0}
    offset = cache.offset
    for i, layer in enumerate(model.layers):
        freqs = None if layer.self_attn.sliding else model.global_freqs()
        x = layer.input_layernorm(h)
        parts["attention"] += statistics.median(sync_time(
            lambda: layer.self_attn(x, cache[i], offset, False, freqs), 1, steps))
        parts["dense MLP"] += statistics.median(sync_time(lambda: layer.mlp(x), 1, steps))

        def moe():
            idx, w = layer.router(h)
            return layer.experts(layer.pre_feedforward_layernorm_2(h), idx, w)

        parts["router + MoE"] += statistics.median(sync_time(moe, 1, steps))
    parts["output head"] = statistics.median(sync_time(lambda: model.logits(h), 1, steps))
    parts["self-conditioning"] = statistics.median(sync_time(
        lambda: model.self_conditioning(h, model.soft_embeddings(logits, dt)), 1, steps))
    parts["sampler"] = statistics.median(sync_time(
        lambda: list(sample_step(logits, 0.6, 0.1, a.vocab_size, mx.random.key(0)).values()), 1, steps))
    return parts


# The prompts of the quality study (``--quality-prompts`` takes the first N).
QUALITY_PROMPTS = ("Why is the sky blue?", "Write a short poem about rivers.", "List three prime numbers.",
                   "What is diffusion?", "Tell me about the moon.")


def quality(model_dir: Path, prompt_len: int, dtype: str | None = None, prompts: int = 3,
            gen_steps: int = 12) -> dict[str, Any]:
    """fast vs exact on the same weights and inputs: per-step logit error and top-1 agreement
    (step 1 without and a step with self-conditioning), and over whole generations with the
    same seed, the share of blocks where both commit the same tokens."""
    from mlx_dgemma import load

    exact = load(model_dir, precision="exact")
    fast = load(model_dir, precision="fast", dtype=dtype)
    return {"fast": fast.precision.label, **logit_agreement(exact.model, fast.model, prompt_len),
            **block_agreement(exact, fast, prompts, gen_steps)}


def paired_steps(exact, other, prompt: mx.array, canvas: mx.array) -> list[tuple[str, mx.array, mx.array]]:
    """Both models on the same input: the plain step's logits, then the self-conditioned step's
    (conditioned on exact's first logits, so both see the same input): [(name, exact, other)]."""
    ce, co = exact.make_cache(), other.make_cache()
    exact.prefill(prompt, ce)
    other.prefill(prompt, co)
    e1, o1 = exact.denoise(canvas, ce), other.denoise(canvas, co)
    sc = e1 / 0.6  # the next step's self-conditioning input, the same for both
    e2, o2 = exact.denoise(canvas, ce, sc), other.denoise(canvas, co, sc)
    return [("step", e1, o1), ("sc_step", e2, o2)]


def logit_agreement(exact, fast, prompt_len: int, seed: int = 0) -> dict[str, float]:
    """Max relative logit error and top-1 agreement of ``fast`` against ``exact``."""
    a = exact.args
    prompt, canvas = random_inputs(a, a.canvas_length, prompt_len, seed)
    out: dict[str, float] = {}
    for name, e, f in paired_steps(exact, fast, prompt, canvas):
        e, f = np.array(e.astype(mx.float32)), np.array(f.astype(mx.float32))
        out[f"{name}_max_rel_logit_error"] = float(np.abs(f - e).max() / np.abs(e).max())
        out[f"{name}_top1_agreement"] = float((f.argmax(-1) == e.argmax(-1)).mean())
    return out


def block_agreement(exact, fast, prompts: int = 3, gen_steps: int = 12) -> dict[str, Any]:
    """Whole generations of two runtimes (``load()``'s), same seeds: share of committed blocks identical in both, and of
    token positions equal within the compared blocks (up to the first block that differs:
    after it the two answers are conditioned on different text)."""
    from mlx_dgemma import BlockEvent, stream_generate

    texts = QUALITY_PROMPTS[:prompts]
    same = total = same_tok = total_tok = 0
    for i, text in enumerate(texts):
        blocks = []
        for rt in (exact, fast):
            evs = stream_generate(rt, text, seed=i, max_denoising_steps=gen_steps,
                                  max_new_tokens=2 * rt.model.args.canvas_length)
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
    from mlx_dgemma import load

    model = load(model_dir, precision="exact").model
    a = model.args
    C = a.canvas_length
    layer = model.layers[0]
    h = mx.random.normal((1, C, a.hidden_size)) * 0.5
    idx, w = layer.router(h)
    x = layer.pre_feedforward_layernorm_2(h)
    mx.eval(idx, w, x)
    ex = layer.experts
    out = {"gather_qmm sorted (ours)": statistics.median(sync_time(lambda: ex(x, idx, w), 1, steps))}

    def unsorted():
        xs = mx.expand_dims(x.reshape(-1, a.hidden_size), (-2, -3))
        ids = idx.reshape(-1, a.top_k_experts)
        gu = ex.gate_up_proj(xs, ids)
        y = ex.down_proj(ex.gated(gu), ids).squeeze(-2)
        return (y * w.reshape(-1, a.top_k_experts, 1)).sum(-2)

    out["gather_qmm unsorted"] = statistics.median(sync_time(unsorted, 1, steps))

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
                                    transpose=True, group_size=gu_w.group_size, bits=gu_w.bits)
            act = ex.gated(g)
            d = mx.quantized_matmul(act, dn["weight"][int(e)], dn["scales"][int(e)], dn["biases"][int(e)],
                                    transpose=True, group_size=dn.group_size, bits=dn.bits)
            y = y.at[mx.array(tok)].add(d * ww[mx.array(tok), mx.array(slot)][:, None])
        return y

    if hasattr(ex.gate_up_proj, "bits"):
        out["per-expert quantized_matmul"] = statistics.median(sync_time(per_expert, 1, steps))
    return out


def sc_top_k_study(model_dir: Path, prompt_len: int, steps: int, ks: tuple[int, ...] = (64, 16)) -> list[dict]:
    """Self-conditioning from each position's ``k`` most likely tokens instead of the whole
    vocabulary: seconds of the soft embedding and the step's max relative logit error, per k."""
    from mlx_dgemma import load

    model = load(model_dir, precision="exact").model
    a = model.args
    prompt, canvas = random_inputs(a, a.canvas_length, prompt_len)
    cache = model.make_cache()
    model.prefill(prompt, cache)
    sc = model.denoise(canvas, cache) / 0.6
    mx.eval(sc)
    exact = model.denoise(canvas, cache, sc)
    t_exact = statistics.median(sync_time(lambda: model.soft_embeddings(sc, mx.float32), 1, steps))
    rows = [{"sc_top_k": None, "soft_embedding_seconds": t_exact, "max_rel_logit_error": 0.0}]
    for k in ks:
        approx = model.denoise(canvas, cache, sc, sc_top_k=k)
        err = float(mx.abs(approx - exact).max() / mx.abs(exact).max())
        t = statistics.median(sync_time(lambda: model.soft_embeddings(sc, mx.float32, top_k=k), 1, steps))
        rows.append({"sc_top_k": k, "soft_embedding_seconds": t, "max_rel_logit_error": err})
    return rows


def compact_study(gguf: Path, model_dir: Path, prompt_len: int, warmup: int, steps: int,
                  timeout: float | None = None) -> dict:
    """The exact and the compact conversion of one GGUF: bytes on disk, seconds per step and
    peak RSS of each (both measured isolated)."""
    from mlx_dgemma.convert.converter import convert

    compact_dir = model_dir.with_name(model_dir.name + "-compact")
    if not compact_dir.is_dir():
        convert(gguf, compact_dir, compact=True)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    # each in the precision it was written in: a compact (fast) directory cannot load as exact
    exact = isolated("measure_ours", timeout=timeout, model_dir=str(model_dir), prompt_len=prompt_len,
                     warmup=warmup, steps=steps, label="exact", precision="exact")
    compact = isolated("measure_ours", timeout=timeout, model_dir=str(compact_dir), prompt_len=prompt_len,
                       warmup=warmup, steps=steps, label="compact", precision="fast")
    return {fmt: {"bytes": size(d), "seconds_per_step": r.get("seconds_per_step"),
                  "peak_rss_bytes": r.get("peak_rss_bytes"), **({"skipped": r["skipped"]} if "skipped" in r else {})}
            for fmt, d, r in (("exact", model_dir, exact), ("compact", compact_dir, compact))}


KJV_TEXTS = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me "
    "beside the still waters. He restoreth my soul: he leadeth me in the paths of righteousness.",
    "And it came to pass in those days, that there went out a decree from Caesar Augustus, that all the "
    "world should be taxed. And all went to be taxed, every one into his own city.",
)


def confident_agreement(exact, other, tok, texts: tuple[str, ...] = KJV_TEXTS) -> dict[str, float]:
    """One decoder step of ``other`` against ``exact`` on real text (for each passage: its first
    half as the prompt, half the continuation known in the canvas, the rest masked), plain and
    self-conditioned: top-1 agreement over all canvas positions and over those where exact is
    confident (p >= 0.5), and the max relative logit error."""
    C = exact.args.canvas_length
    same: dict[str, list] = {"step": [], "sc_step": []}
    conf: dict[str, list] = {"step": [], "sc_step": []}
    err = {"step": 0.0, "sc_step": 0.0}
    for text in texts:
        ids = tok.encode(text)
        prompt = mx.array([ids[: len(ids) // 2]], dtype=mx.int32)
        rest = ids[len(ids) // 2:][:C]
        canvas = np.full(C, exact.args.mask_token_id, dtype=np.int32)
        canvas[: len(rest) // 2] = rest[: len(rest) // 2]
        canvas = mx.array(canvas[None])
        for name, e, o in paired_steps(exact, other, prompt, canvas):
            e, o = np.array(e.astype(mx.float32))[0], np.array(o.astype(mx.float32))[0]
            p = np.exp(e - e.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            same[name].append(o.argmax(-1) == e.argmax(-1))
            conf[name].append(p.max(-1) >= 0.5)
            err[name] = max(err[name], float(np.abs(o - e).max() / np.abs(e).max()))
    out: dict[str, float] = {}
    for name in ("step", "sc_step"):
        s, c = np.concatenate(same[name]), np.concatenate(conf[name])
        out[f"{name}_top1"] = float(s.mean())
        out[f"{name}_top1_confident"] = float(s[c].mean()) if c.any() else float("nan")
        out[f"{name}_confident_positions"] = int(c.sum())
        out[f"{name}_positions"] = int(c.size)
        out[f"{name}_max_rel_logit_error"] = err[name]
    return out
