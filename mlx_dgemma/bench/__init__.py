"""``mlx-dgemma bench``: seconds per denoising step, prefill tokens/s and peak memory on random
weights, with peers measured in the same run on the same weights:

* mlx-vlm's DiffusionGemma (``mlx_vlm.models.diffusion_gemma``), dense with the GGUF's
  dequantized weights, and re-quantized by its own stock recipe (4-bit, group 64);
* the Hugging Face reference in torch eager mode (context only: torch's CPU GEMM is far
  faster than MLX's CPU backend, so that ratio does not carry over to Apple silicon).

Also: our FLOP/s against MLX's own dense matmul throughput, a per-part breakdown of a step,
the MoE alternatives, sparse self-conditioning and the exact vs compact formats. Prints a
table and writes JSON.

The package, one module per part: ``configs`` (the random models), ``isolate`` (one
measurement per process), ``measure`` (the table's rows: ours and the peers), ``peers`` (the
peer models holding a GGUF's weights, shared with the parity tests), ``studies``, ``flops``
(the FLOP model and MLX's matmul ceiling), ``timing`` and ``report``. This module holds the
command: its arguments, :func:`run` and :func:`main`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dgemma.errors import ParameterError

from .configs import CONFIGS, build, random_inputs
from .flops import dense_matmul_gflops, step_flops
from .isolate import CHILD_TIMEOUT, isolated
from .measure import measure_hf, measure_mlx_vlm, measure_ours
from .report import machine, table
from .studies import (block_agreement, breakdown, compact_study, logit_agreement, moe_alternatives, quality,
                      sc_top_k_study)

# The names `isolated` resolves a bare target against, and what benchmarks/ and tests import.
__all__ = ["CONFIGS", "CHILD_TIMEOUT", "EXTRAS", "PEERS", "add_args", "block_agreement", "breakdown", "build", "compact_study",
           "dense_matmul_gflops", "isolated", "logit_agreement", "machine", "main", "measure_hf",
           "measure_mlx_vlm", "measure_ours", "moe_alternatives", "quality", "random_inputs", "run",
           "sc_top_k_study", "step_flops", "table"]


PEERS = ("mlx-vlm", "mlx-vlm-q4", "hf")
EXTRAS = ("breakdown", "quality", "moe", "sc", "compact")


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of ``mlx-dgemma bench``."""
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
    p.add_argument("--e2e", action="store_true",
                   help="instead: answer tokens/s end to end on trained weights, ours vs mlx-vlm's own loop "
                        "(mlx_dgemma.bench.e2e)")
    p.add_argument("--e2e-models", help="--e2e: comma-separated GGUF files (default: the trained demo)")
    p.add_argument("--e2e-prompts", type=int, default=8, help="--e2e: how many of its 8 prompts to run")


def run(args: argparse.Namespace) -> dict:
    """Build each config's random model, measure ours and the peers (each isolated), run the
    studies asked for; the result as JSON-ready data."""
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ParameterError(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    peers = [] if args.peers == "none" else [p.strip() for p in args.peers.split(",")]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:  # before any measurement: a typo should not cost the first config's run
        raise ParameterError(f"--peers: unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)} (or 'none')")
    extras = [] if args.extras == "none" else [e.strip() for e in args.extras.split(",")]
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ParameterError(f"--extras: unknown study {unknown[0]!r}; choose from {', '.join(EXTRAS)} (or 'none')")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or any(p not in ("exact", "fast") for p in precisions):
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
            else:  # checked above
                raise AssertionError(peer)
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


def main(args: argparse.Namespace) -> int:
    """``mlx-dgemma bench``: run, print the table, write the JSON."""
    if getattr(args, "e2e", False):
        from .e2e import main as e2e_main

        return e2e_main(args)
    result = run(args)
    print(table(result))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0
