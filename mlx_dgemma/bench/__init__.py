"""``mlx-dgemma bench``: seconds per denoising step, prefill tokens/s and peak memory on random
weights, with peers measured in the same run on the same weights:

* mlx-vlm's DiffusionGemma (``mlx_vlm.models.diffusion_gemma``), dense with the GGUF's
  dequantized weights, and re-quantized by its own stock recipe (4-bit, group 64);
* the Hugging Face reference in torch eager mode (context only: torch's CPU GEMM is far
  faster than MLX's CPU backend, so that ratio does not carry over to Apple silicon).

Also: our FLOP/s against MLX's own dense matmul throughput, a per-part breakdown of a step,
the MoE alternatives, sparse self-conditioning and the exact vs compact formats. Prints a
table and writes JSON. Every flag is checked before anything is measured; each finished row
is logged and written to the JSON at once, and Ctrl+C keeps and prints what had finished.

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
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dgemma.errors import ParameterError, Terminated
from mlx_dgemma.paths import EMPTY, OutputFile, check_output_file, empty_path, open_output, user_path

from .configs import CONFIGS, CONTEXT, build, model_paths, random_inputs
from .flops import dense_matmul_gflops, step_flops
from .isolate import CHILD_TIMEOUT, isolated
from .measure import measure_hf, measure_mlx_vlm, measure_ours
from .report import machine, row_line, table
from .studies import (QUALITY_PROMPTS, block_agreement, breakdown, compact_study, logit_agreement, moe_alternatives,
                      quality, sc_top_k_study)
from .timing import log

# The names `isolated` resolves a bare target against, and what benchmarks/ and tests import.
__all__ = ["CONFIGS", "CHILD_TIMEOUT", "EXTRAS", "PEERS", "Plan", "add_args", "block_agreement", "breakdown",
           "build", "check_args", "compact_study", "dense_matmul_gflops", "isolated", "logit_agreement", "machine",
           "main", "measure_hf", "measure_mlx_vlm", "measure_ours", "moe_alternatives", "quality", "random_inputs",
           "run", "sc_top_k_study", "step_flops", "table"]


PEERS = ("mlx-vlm", "mlx-vlm-q4", "hf")
EXTRAS = ("breakdown", "quality", "moe", "sc", "compact")


# flag: (attribute, low, high); every integer flag is checked against its range before any work.
# A prompt and its canvas must also fit in the random models' context (configs.CONTEXT).
INT_FLAGS = {"--canvas": ("canvas", 1, CONTEXT), "--prompt-len": ("prompt_len", 1, CONTEXT - 1),
             "--steps": ("steps", 1, 10_000), "--warmup": ("warmup", 0, 10_000),
             "--quality-prompts": ("quality_prompts", 1, len(QUALITY_PROMPTS))}
CHILD_TIMEOUT_RANGE = (1.0, 1e7)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with each option's default, where it has one and its help does not already
    say it (argparse's own formatter also prints "(default: None)" and repeats stated ones)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)"


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of ``mlx-dgemma bench``."""
    p.add_argument("--configs", default="tiny,medium", help="comma-separated: tiny, medium, real-shapes")
    p.add_argument("--canvas", type=int, metavar="N",
                   help=f"override the canvas length, 1 to {CONTEXT} (e.g. 32 for real-shapes on a CPU)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N",
                   help="tokens in the cache before the canvas (default 512)")
    p.add_argument("--steps", type=int, default=3, metavar="N", help="timed steps (median reported), at least 1")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed steps before the timed ones")
    p.add_argument("--precisions", default="exact,fast",
                   help="runtime precisions of ours to measure, side by side (exact, fast, q4, q3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype of fast (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--peers", default="mlx-vlm,mlx-vlm-q4,hf", help="comma-separated peers, or 'none'")
    p.add_argument("--extras", default="breakdown,quality,moe,sc,compact",
                   help="comma-separated extra studies: breakdown, quality, moe, sc, compact (or 'none')")
    p.add_argument("--quality-prompts", type=int, default=3, metavar="N",
                   help=f"generations (exact and fast, same seeds) compared block by block in the quality study, "
                        f"1 to {len(QUALITY_PROMPTS)}")
    p.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT, metavar="SECONDS",
                   help="seconds one isolated measurement may take before it is reported as timed out")
    p.add_argument("--no-eager", action="store_true", help="skip the eager (uncompiled) step measurements")
    p.add_argument("--workdir", default=".bench-cache", metavar="DIR",
                   help="where the random models are written (reused)")
    p.add_argument("--json", default="bench.json", metavar="FILE",
                   help="write the results here (rewritten as each measurement finishes)")
    p.add_argument("--e2e", action="store_true",
                   help="instead: answer tokens/s end to end on trained weights, ours vs mlx-vlm's own loop "
                        "(mlx_dgemma.bench.e2e)")
    p.add_argument("--e2e-models", help="--e2e: comma-separated GGUF files (default: the trained demo)")
    p.add_argument("--e2e-prompts", type=int, default=8, help="--e2e: how many of its 8 prompts to run")
    p.add_argument("--e2e-interleave", action="store_true",
                   help="--e2e: the rows take turns prompt by prompt (one long-lived process each) instead of "
                        "running one after the other: fair ratios on a machine whose load changes")


@dataclass(frozen=True)
class Plan:
    """What a run measures, from its flags, every one checked."""

    names: list[str]
    peers: list[str]
    extras: list[str]
    precisions: list[str]
    workdir: Path
    json: OutputFile


def _items(flag: str, value: str, allowed: tuple[str, ...], what: str, none_ok: bool = True) -> list[str]:
    if none_ok and value.strip() == "none":
        return []
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise ParameterError(f"{flag}: {f'unknown {what} {unknown[0]!r}' if unknown else f'no {what} in {value!r}'}"
                             f"; choose from {', '.join(allowed)}{' (or none)' if none_ok else ''}")
    return list(dict.fromkeys(items))


def _check_workdir(path: Path) -> None:
    """``path`` is, or can be created as, a writable directory (nothing is created here)."""
    if path.exists() and not path.is_dir():
        raise ParameterError(f"--workdir {path}: exists and is not a directory; give a directory (the "
                             "random models are cached there)")
    base = path
    while not base.exists():  # the first existing ancestor: mkdir will create the rest
        base = base.parent
    if not base.is_dir():
        raise ParameterError(f"--workdir {path}: {base} is not a directory; give another --workdir")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ParameterError(f"--workdir {path}: {base} is not writable; give another --workdir")


def check_args(args: argparse.Namespace) -> Plan:
    """Every flag against its range, the flag combinations and the output paths, before any
    measurement: a typo must not cost a config's run, nor its results at the end."""
    names = _items("--configs", args.configs, tuple(CONFIGS), "config", none_ok=False)
    peers = _items("--peers", args.peers, PEERS, "peer")
    extras = _items("--extras", args.extras, EXTRAS, "study")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    from mlx_dgemma.tiers import TIERS

    if not precisions or any(p not in TIERS for p in precisions):
        raise ParameterError(f"--precisions: {args.precisions!r}; give a comma-separated list of {', '.join(TIERS)}")
    precisions = list(dict.fromkeys(precisions))
    for flag, (attr, low, high) in INT_FLAGS.items():
        v = getattr(args, attr, None)
        if v is not None and not low <= v <= high:
            raise ParameterError(f"{flag} {v}: must be an integer in [{low}, {high}]")
    canvas = args.canvas or max(CONFIGS[n]["canvas_length"] for n in names)
    if args.prompt_len + canvas > CONTEXT:
        given = f" + --canvas {canvas}" if args.canvas else f" with a canvas of {canvas}"
        raise ParameterError(f"--prompt-len {args.prompt_len}{given}: {args.prompt_len + canvas} tokens exceed the "
                             f"random models' context of {CONTEXT}; lower --prompt-len"
                             f"{' or --canvas' if args.canvas else ''}")
    t = args.child_timeout
    low, high = CHILD_TIMEOUT_RANGE
    if not (math.isfinite(t) and low <= t <= high):
        raise ParameterError(f"--child-timeout {t}: must be a number of seconds in [{low:.0f}, {high:.0f}]")
    if args.dtype not in (None, "float32") and "fast" not in precisions:
        raise ParameterError(f"--dtype {args.dtype}: sets the dtype of fast precision, which --precisions "
                             f"{args.precisions!r} does not measure (exact is float32); add fast to "
                             "--precisions or leave --dtype out")
    if empty_path(args.workdir):  # not ".": the current directory filled with random models
        raise ParameterError(f"--workdir {args.workdir!r}: {EMPTY}; give a directory (the random models are cached "
                             "there)")
    workdir = user_path(args.workdir)
    _check_workdir(workdir)
    # never over the random models this run reads (cached in --workdir)
    inputs = [p for n in names for p in model_paths(n, workdir, args.canvas)]
    out = check_output_file(args.json, "--json", inputs, example="bench.json")
    return Plan(names, peers, extras, precisions, workdir, out)


def _dtype(prec: str, dtype: str | None) -> str | None:
    """``--dtype`` is fast's activation dtype; exact always runs in float32."""
    return dtype if prec == "fast" else None


def _row_done(name: str, row: dict, save: Callable[[], None]) -> None:
    """A finished row: saved to the JSON at once and shown on stderr, so nothing finished is
    lost to a later crash or Ctrl+C."""
    save()
    log(f"{name}: {row_line(row)}")


def run(args: argparse.Namespace, save: Callable[[dict], None] | None = None,
        plan: Plan | None = None) -> dict:
    """Build each config's random model, measure ours and the peers (each isolated), run the
    studies asked for; the result as JSON-ready data. ``save`` is called with the result so
    far each time a measurement finishes (the same dict, growing)."""
    plan = plan or check_args(args)
    names, peers, extras, precisions = plan.names, plan.peers, plan.extras, plan.precisions
    timeout = args.child_timeout
    result: dict[str, Any] = {"machine": machine(), "dense_matmul_gflops": {}, "configs": {}}

    def saved() -> None:
        if save is not None:
            save(result)

    for dt_name, dt in (("float32", mx.float32), ("bfloat16", mx.bfloat16)):
        result["dense_matmul_gflops"][dt_name] = dense_matmul_gflops(dt)
    saved()
    for name in names:
        log(f"{name}: building the random model")
        gguf, model_dir = build(name, plan.workdir, args.canvas)
        canvas = json.loads((model_dir / "config.json").read_text())["canvas_length"]
        entry: dict[str, Any] = {"rows": []}
        result["configs"][f"{name} (canvas {canvas})"] = entry
        ours_rows = []
        for prec in precisions:
            log(f"{name}: mlx-dgemma {prec}")
            ours = isolated("measure_ours", timeout=timeout, model_dir=str(model_dir),
                            prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps,
                            eager=not args.no_eager, precision=prec, dtype=_dtype(prec, args.dtype), label=None)
            if "skipped" in ours:  # reported in the table; the peers are still measured
                ours["impl"] = f"mlx-dgemma {prec}"
                entry["rows"].append(ours)
                _row_done(name, ours, saved)
                continue
            ours["achieved_gflops"] = ours["flops_per_step"] / ours["seconds_per_step"] / 1e9
            dense = result["dense_matmul_gflops"].get(ours["dtype"], result["dense_matmul_gflops"]["float32"])
            ours["fraction_of_dense_matmul"] = ours["achieved_gflops"] / dense
            ours["vs"] = {}
            entry["rows"].append(ours)
            ours_rows.append(ours)
            _row_done(name, ours, saved)
        missing: set[str] = set()  # peer packages found missing: one line each, not one per peer
        for peer in peers:
            common = dict(gguf=str(gguf), prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps)
            if peer in ("mlx-vlm", "mlx-vlm-q4"):
                if "mlx_vlm" in missing:
                    continue
                log(f"{name}: {peer}")
                row = isolated("measure_mlx_vlm", timeout=timeout, quantized=peer == "mlx-vlm-q4", **common)
            elif peer == "hf":
                log(f"{name}: {peer}")
                row = isolated("measure_hf", timeout=timeout, **common)
            else:  # checked above
                raise AssertionError(peer)
            if "missing" in row:
                missing.add(row.pop("missing"))
                row["impl"] = "mlx-vlm" if peer.startswith("mlx-vlm") else "transformers"
            if "seconds_per_step" in row:
                for ours in ours_rows:
                    ours["vs"][row["impl"]] = ours["seconds_per_step"] / row["seconds_per_step"]
            entry["rows"].append(row)
            _row_done(name, row, saved)
            gc.collect()
        if "breakdown" in extras:
            log(f"{name}: breakdown")
            entry["breakdown"] = {}
            for prec in precisions:
                entry["breakdown"][prec] = isolated("breakdown", timeout=timeout, model_dir=str(model_dir),
                                                    prompt_len=args.prompt_len, steps=args.steps, precision=prec,
                                                    dtype=_dtype(prec, args.dtype))
                saved()
        if "quality" in extras:
            log(f"{name}: quality")
            entry["quality"] = isolated("quality", timeout=timeout, model_dir=str(model_dir),
                                        prompt_len=args.prompt_len, dtype=args.dtype, prompts=args.quality_prompts)
            saved()
        if "moe" in extras:
            log(f"{name}: MoE alternatives")
            entry["moe"] = isolated("moe_alternatives", timeout=timeout, model_dir=str(model_dir), steps=args.steps)
            saved()
        if "sc" in extras:
            log(f"{name}: sparse self-conditioning")
            entry["sc_top_k"] = isolated("sc_top_k_study", timeout=timeout, model_dir=str(model_dir),
                                         prompt_len=args.prompt_len, steps=args.steps)
            saved()
        if "compact" in extras:
            log(f"{name}: exact vs compact")
            entry["formats"] = compact_study(gguf, model_dir, args.prompt_len, args.warmup, args.steps,
                                             timeout=timeout)
            saved()
    return result


class JsonWriter:
    """Rewrites the JSON file whole (a temporary file renamed over it) each time it is called,
    so the file is always complete: what had finished when a run stopped. A FIFO or device
    (``--json /dev/stdout`` into a pipe) gets the result once, when the run ends (``final``):
    each rewrite there would be another document after the last."""

    def __init__(self, out: OutputFile):
        self.out = out
        self.result: dict | None = None

    def __call__(self, result: dict, final: bool = False) -> None:
        self.result = result
        if self.out.in_place and not final:
            return
        with open_output(self.out) as f:
            f.write(json.dumps(result, indent=2) + "\n")


def _finished_rows(result: dict | None) -> int:
    return sum(len(e["rows"]) for e in result["configs"].values()) if result else 0


def main(args: argparse.Namespace) -> int:
    """``mlx-dgemma bench``: run, print the table, write the JSON (after each finished
    measurement). Ctrl+C (or SIGTERM) keeps and prints what had finished. ``--e2e``: the
    end-to-end comparison on trained weights instead (:mod:`mlx_dgemma.bench.e2e`)."""
    if getattr(args, "e2e", False):
        from .e2e import main as e2e_main

        return e2e_main(args)
    plan = check_args(args)
    writer = JsonWriter(plan.json)
    try:
        result = run(args, save=writer, plan=plan)
    except KeyboardInterrupt as e:
        code = 128 + e.signum if isinstance(e, Terminated) else 130
        if writer.result is None:
            print("mlx-dgemma bench: interrupted before any measurement finished; nothing was written",
                  file=sys.stderr)
            return code
        writer.result["interrupted"] = True
        writer(writer.result, final=True)
        print(table(writer.result))
        rows = _finished_rows(writer.result)
        kept = f"the {rows} finished row(s)" if rows else "the matmul probe (no row had finished)"
        print(f"mlx-dgemma bench: interrupted; kept {kept} in {plan.json.given}", file=sys.stderr)
        return code
    writer(result, final=True)
    print(table(result))
    print(f"\nwrote {plan.json.given}", file=sys.stderr)
    return 0
