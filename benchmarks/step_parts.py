"""Where a denoising step's time goes, ours against mlx-vlm's, part by part, in one process.

Each part of a decoder step (attention of every layer, dense MLP, router + MoE, output head,
self-conditioning, our sampler) is timed with the step's shapes for: ours as loaded
(``--precision``), ours with every quantized weight dequantized to a dense float32 copy (the
same values: what MLX's CPU quantized kernels cost against its dense GEMM), and mlx-vlm's
modules holding the same values dense in float32. The three are timed in turn, repetition by
repetition, so a shared machine's changing load hits them alike; medians are reported.

    python benchmarks/step_parts.py                          # the trained demo, its e2e prompt
    python benchmarks/step_parts.py --model .bench-cache/medium-c256.gguf --prompt-len 512

Backend: MLX's default device. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def densified(model: nn.Module) -> nn.Module:
    """``model`` with every quantized module replaced by a dense float32 one of the same values."""
    from mlx_dgemma.precision import _is_quantized
    from mlx_dgemma.quantized import FloatEmbedding, GGUFQuantizedEmbedding, GGUFQuantizedSwitchLinear, _tree
    from mlx_dgemma.schema import unpad_subblocks
    from mlx_dgemma.switch_layers import SwitchLinear

    swaps = []
    for path, m in model.named_modules():
        if not _is_quantized(m):
            continue
        w = unpad_subblocks(mx.dequantize(m["weight"], m["scales"].astype(mx.float32),
                                          m["biases"].astype(mx.float32), group_size=m.group_size, bits=m.bits),
                            m.subblock)
        if isinstance(m, GGUFQuantizedEmbedding):
            d = FloatEmbedding(*w.shape)
        elif isinstance(m, GGUFQuantizedSwitchLinear):
            e, o, i = w.shape
            d = SwitchLinear(i, o, e, bias=False)
        else:
            d = nn.Linear(w.shape[1], w.shape[0], bias=False)
        d.weight = w
        swaps.append((path, d))
    model.update_modules(_tree(swaps))
    mx.eval(model.parameters())
    return model


def our_parts(model, cache, canvas, sc_logits, h, sc_top_k) -> dict:
    from mlx_dgemma.sampler import sample_step

    a, dt = model.args, mx.float32
    freqs = model.global_freqs()
    parts = {
        "attention": lambda: [layer.self_attn(layer.input_layernorm(h), cache[i], cache.offset, False,
                                              None if layer.self_attn.sliding else freqs)
                              for i, layer in enumerate(model.layers)],
        "dense MLP": lambda: [layer.mlp(layer.pre_feedforward_layernorm(h)) for layer in model.layers],
        "router + MoE": lambda: [layer.experts(layer.pre_feedforward_layernorm_2(h), *layer.router(h))
                                 for layer in model.layers],
        "output head": lambda: model.logits(model.norm(h)),
        "self-conditioning": lambda: model.self_conditioning(model.embed(canvas, dt),
                                                             model.soft_embeddings(sc_logits, dt, sc_top_k)),
        "sampler": lambda: list(sample_step(sc_logits, 0.2, 0.1, a.vocab_size, mx.random.key(0)).values()),
    }
    return parts


def vlm_parts(vlm, cache, canvas, sc_logits, h) -> dict:
    from mlx_vlm.models.diffusion_gemma.language import _cache_offset

    dec = vlm.language_model.model
    masks = dec._make_decoder_masks(h, cache)
    off = _cache_offset(cache[0])
    emb = vlm.diffusion_prepare_self_conditioning()
    cap = vlm.config.text_config.final_logit_softcapping

    def moe(layer):
        flat = h.reshape(-1, h.shape[-1])
        idx, w = layer.router(flat)
        return (layer.experts(layer.pre_feedforward_layernorm_2(flat), idx) * w[..., None]).sum(axis=-2)

    return {
        "attention": lambda: [layer.self_attn(layer.input_layernorm(h), masks.get(layer.layer_type), c, decoder=True,
                                              offset=off) for layer, c in zip(dec.layers, cache)],
        "dense MLP": lambda: [layer.mlp(layer.pre_feedforward_layernorm(h)) for layer in dec.layers],
        "router + MoE": lambda: [moe(layer) for layer in dec.layers],
        "output head": lambda: mx.tanh(dec.embed_tokens.as_linear(dec.norm(h)) / cap) * cap,
        # its step's next self-conditioning input, then the embedding mix at the next step
        "self-conditioning": lambda: dec._embed_canvas(canvas, None, vlm.diffusion_self_conditioning(sc_logits, emb)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF (default: the trained demo)")
    p.add_argument("--precision", default="fast")
    p.add_argument("--prompt-len", type=int, help="random prompt of this length (default: the demo's e2e prompt)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default="step-parts.json")
    args = p.parse_args()

    from mlx_dgemma import load
    from mlx_dgemma.bench.e2e import PROMPTS, _prompt_ids
    from mlx_dgemma.bench.peers import mlx_vlm_model_from_gguf
    from mlx_dgemma.demo import trained_demo_path
    from mlx_dgemma.sampler import SamplerParams

    gguf = Path(args.model or trained_demo_path())
    rt = load(str(gguf), precision=args.precision)
    ours, tok = rt.model, rt.tokenizer
    dense = densified(load(str(gguf), precision=args.precision).model)
    vlm = mlx_vlm_model_from_gguf(gguf, dtype=mx.float32)
    a = ours.args
    C = a.canvas_length
    rng = np.random.default_rng(0)
    ids = (_prompt_ids(tok, PROMPTS[0]) if args.prompt_len is None
           else rng.integers(0, a.vocab_size, args.prompt_len).tolist())
    prompt = mx.array([ids], dtype=mx.int32)
    canvas = mx.array(rng.integers(0, a.vocab_size, (1, C)), dtype=mx.int32)
    h = mx.array(rng.standard_normal((1, C, a.hidden_size)).astype(np.float32) * 0.5)
    caches = {"ours": ours.make_cache(), "ours, dense f32 weights": dense.make_cache()}
    ours.prefill(prompt, caches["ours"])
    dense.prefill(prompt, caches["ours, dense f32 weights"])
    vcache = vlm.make_cache()
    vlm.diffusion_prefill_cache(prompt, cache=vcache)
    sc = ours.denoise(canvas, caches["ours"]) / 0.2
    mx.eval(sc, h, [c.state for c in vcache])
    k = rt.sc_top_k(SamplerParams.from_config(rt.generation_config))
    impls = {"ours": our_parts(ours, caches["ours"], canvas, sc, h, k),
             "ours, dense f32 weights": our_parts(dense, caches["ours, dense f32 weights"], canvas, sc, h, k),
             "mlx-vlm dense f32": vlm_parts(vlm, vcache, canvas, sc, h)}
    times: dict[str, dict[str, list[float]]] = {i: {n: [] for n in parts} for i, parts in impls.items()}
    for rep in range(args.reps + 1):  # the first is a warm-up
        for impl, parts in impls.items():
            for name, fn in parts.items():
                t0 = time.perf_counter()
                mx.eval(fn())
                if rep:
                    times[impl][name].append(time.perf_counter() - t0)
    med = {i: {n: statistics.median(v) * 1000 for n, v in parts.items()} for i, parts in times.items()}
    names = list(impls["ours"])
    print(f"{gguf.name}, precision {ours.precision.label}, prompt {len(ids)} tokens, canvas {C}, "
          f"{args.reps} reps, device {mx.default_device()}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'part (ms, median)':<20}" + "".join(f"{i:>26}" for i in impls) + f"{'ours / mlx-vlm':>16}")
    for n in names + ["total"]:
        row = [sum(med[i].get(x, 0.0) for x in (names if n == "total" else [n])) for i in impls]
        vlm_t = row[-1] if n != "sampler" else None
        ratio = f"{row[0] / vlm_t:.2f}x" if vlm_t else "-"
        print(f"{n:<20}" + "".join(f"{x:>26.1f}" for x in row) + f"{ratio:>16}")
    Path(args.json).write_text(json.dumps({"model": str(gguf), "precision": ours.precision.label, "prompt_tokens": len(ids),
                                           "canvas": C, "reps": args.reps, "median_ms": med}, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
