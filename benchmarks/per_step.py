"""Seconds per denoising step, ours against mlx-vlm dense float32, in interleaved rounds.

``mlx-dgemma bench`` measures its rows one after the other; on a machine shared with other
jobs the load changes between rows, so a ratio of two rows can be off by 2-5x. Here every
round measures each row once (each in its own process, as bench does: ``bench.isolated``), in
the same order, and the table reports each row's median over the rounds and the median of the
per-round ratios to mlx-vlm, with the load average before each round.

    python benchmarks/per_step.py --config medium --rounds 3
    python benchmarks/per_step.py --config real-shapes --canvas 32 --prompt-len 256 --rounds 1 --steps 2

Backend: whatever MLX's default device is (the CPU here). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from mlx_dgemma.bench import build, isolated, machine
from mlx_dgemma.bench.timing import log

ROWS = ("exact", "fast", "mlx-vlm")


def one_round(gguf: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    out = {"load_average": os.getloadavg()}
    for row in args.rows.split(","):
        common = dict(prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps)
        floor = int(args.min_free_gb * 1e9)
        if row == "mlx-vlm":
            r = isolated("measure_mlx_vlm", timeout=args.child_timeout, min_available_bytes=floor, gguf=str(gguf),
                         quantized=False, **common)
        else:
            r = isolated("measure_ours", timeout=args.child_timeout, min_available_bytes=floor,
                         model_dir=str(model_dir), precision=row, eager=False, label=None, **common)
        log(f"{row}: {r.get('seconds_per_step', r.get('skipped'))}")
        out[row] = r
    out["load_average_after"] = os.getloadavg()
    return out


def same_process(gguf: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    """All rows loaded in one process and timed whole step by whole step in turn (ours: the
    compiled step, as generation runs it; mlx-vlm: its decoder pass and next self-conditioning,
    as ``bench`` times it): the fairest ratio on a machine whose load changes by the minute."""
    import mlx.core as mx

    from mlx_dgemma import load
    from mlx_dgemma.bench.configs import random_inputs
    from mlx_dgemma.bench.peers import mlx_vlm_model_from_gguf
    from mlx_dgemma.sampler import SamplerParams
    from mlx_dgemma.step import StepFunction

    steps = {}
    for row in args.rows.split(","):
        if row == "mlx-vlm":
            vlm = mlx_vlm_model_from_gguf(gguf, dtype=mx.float32)
            C = vlm.config.canvas_length
            prompt, canvas = random_inputs(vlm.config.text_config, C, args.prompt_len)
            vc = vlm.make_cache()
            vlm.diffusion_prefill_cache(prompt, cache=vc)
            emb = vlm.diffusion_prepare_self_conditioning()
            vsc = vlm.diffusion_self_conditioning(vlm.diffusion_decoder_logits(canvas, cache=vc), emb)
            mx.eval(vsc, [c.state for c in vc])
            steps[row] = (lambda vlm=vlm, canvas=canvas, vc=vc, vsc=vsc, emb=emb: vlm.diffusion_self_conditioning(
                vlm.diffusion_decoder_logits(canvas, cache=vc, self_conditioning=vsc), emb))
        else:
            rt = load(str(model_dir), precision=row)
            m = rt.model
            C = m.args.canvas_length
            prompt, canvas = random_inputs(m.args, C, args.prompt_len)
            cache = m.make_cache()
            m.prefill(prompt, cache)
            sc = m.denoise(canvas, cache)
            mx.eval(sc)
            fn = rt.step(SamplerParams())  # the runtime's: its dtype and fast's sc_top_k
            hist = fn.initial_history((1, C))
            steps[row] = (lambda fn=fn, canvas=canvas, sc=sc, hist=hist, cache=cache:
                          list(fn(canvas, sc, 0.6, mx.random.key(0), hist, cache).values()))
        log(f"{row}: ready")
    times = {row: [] for row in steps}
    for rep in range(args.warmup + args.steps):
        for row, fn in steps.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            if rep >= args.warmup:
                times[row].append(time.perf_counter() - t0)
        log(f"rep {rep + 1}: " + ", ".join(f"{r} {t[-1]:.2f} s" for r, t in times.items() if t))
    out = {"load_average": os.getloadavg(), "load_average_after": os.getloadavg(), "same_process": True,
           **{row: {"seconds_per_step": statistics.median(t), "all_seconds": t} for row, t in times.items()}}
    if "mlx-vlm" in times:  # each step against the mlx-vlm step timed next to it
        for row, t in times.items():
            out[row]["median_step_ratio_to_mlx_vlm"] = statistics.median(a / b for a, b in zip(t, times["mlx-vlm"]))
            log(f"{row}: median of step-by-step ratios to mlx-vlm {out[row]['median_step_ratio_to_mlx_vlm']:.2f}x")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="medium")
    p.add_argument("--canvas", type=int)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, in order: {', '.join(ROWS)}")
    p.add_argument("--min-free-gb", type=float, default=2.0,
                   help="stop a row when the machine's available memory falls below this")
    p.add_argument("--child-timeout", type=float, default=7200.0)
    p.add_argument("--workdir", default=".bench-cache")
    p.add_argument("--json", default="per-step.json")
    p.add_argument("--same-process", action="store_true",
                   help="load every row in one process and alternate whole steps (each round = --steps "
                        "steps of each row in turn) instead of one process per row")
    args = p.parse_args()
    gguf, model_dir = build(args.config, Path(args.workdir), args.canvas)
    rows = args.rows.split(",")
    result = {"machine": machine(), "config": args.config, "canvas": args.canvas, "prompt_len": args.prompt_len,
              "rounds": []}
    for i in range(args.rounds):
        log(f"round {i + 1}/{args.rounds}, load average {os.getloadavg()[0]:.1f}")
        result["rounds"].append(same_process(gguf, model_dir, args) if args.same_process
                                else one_round(gguf, model_dir, args))
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    summary = {}
    for row in rows:
        secs = [r[row]["seconds_per_step"] for r in result["rounds"] if "seconds_per_step" in r[row]]
        ratios = [r[row]["seconds_per_step"] / r["mlx-vlm"]["seconds_per_step"] for r in result["rounds"]
                  if "seconds_per_step" in r[row] and "seconds_per_step" in r.get("mlx-vlm", {})]
        summary[row] = {"median_seconds_per_step": statistics.median(secs) if secs else None,
                        "seconds_per_step": secs,
                        "median_ratio_to_mlx_vlm": statistics.median(ratios) if ratios else None,
                        "ratios_to_mlx_vlm": ratios}
    result["summary"] = summary
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['machine']['platform']} ({result['machine']['device']}, mlx {result['machine']['mlx']}); "
          f"{args.config}, canvas {args.canvas or 'default'}, prompt {args.prompt_len}, {len(result['rounds'])} rounds")
    print("load average before each round: " + ", ".join(f"{r['load_average'][0]:.1f}" for r in result["rounds"]))
    print(f"{'row':<10} {'median s/step':>14} {'per round':<30} {'vs mlx-vlm (median of rounds)':>30}")
    for row, s in summary.items():
        med = f"{s['median_seconds_per_step']:.2f}" if s["median_seconds_per_step"] else "-"
        ratio = f"{s['median_ratio_to_mlx_vlm']:.2f}x" if s["median_ratio_to_mlx_vlm"] else "-"
        print(f"{row:<10} {med:>14} {', '.join(f'{x:.2f}' for x in s['seconds_per_step']):<30} {ratio:>30}")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
