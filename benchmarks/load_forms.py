"""Issue 30 item 3 on a benchmark model: the lossy forms against exact, each pair in turn.

    python benchmarks/load_forms.py [--config medium] [--reps 3] [--workdir DIR] [--json out.json]

Rows, interleaved rep by rep (so a load change on a shared machine hits both sides alike):
``convert`` exact vs ``convert --precision q4`` of the config's synthetic Q4_K_M GGUF, and
loading the exact directory as ``exact`` vs as ``fast`` (fast's padded Q6_K/Q3_K tensors read
from the directory's sidecar, which ``convert`` writes, scales cast; before the sidecar they were
re-quantized at every load, which ``benchmarks/fast_requantize.py`` still times alone). The target: each lossy form within 2x its exact
counterpart. Prints a table, then JSON (medians, every rep, the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_dgemma.bench.configs import build
from mlx_dgemma.bench.report import machine
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.loader import load

PAIRS = (("convert exact", "convert q4"), ("load exact", "load fast from exact"))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _load(path: Path, precision: str) -> None:
    rt = load(path, precision=precision)
    mx.eval(rt.model.parameters())  # resident, not lazily pending


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="medium")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlx-dgemma-bench")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    gguf, exact_dir = build(args.config, args.workdir, None)
    scratch = Path(tempfile.mkdtemp(prefix="load-forms-"))
    runs: dict[str, list[float]] = {name: [] for pair in PAIRS for name in pair}
    try:
        for rep in range(args.reps):
            for precision, name in (("exact", "convert exact"), ("q4", "convert q4")):
                out = scratch / f"{precision}-{rep}"
                runs[name].append(_timed(lambda: convert(gguf, out, precision=precision)))
                shutil.rmtree(out)
            runs["load exact"].append(_timed(lambda: _load(exact_dir, "exact")))
            runs["load fast from exact"].append(_timed(lambda: _load(exact_dir, "fast")))
            print(f"[load_forms] rep {rep + 1}/{args.reps}: " +
                  ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    lines = [f"{'row':<22} {'median s':>9} {'vs exact':>9}"]
    for exact, lossy in PAIRS:
        lines.append(f"{exact:<22} {med[exact]:>9.2f} {'':>9}")
        lines.append(f"{lossy:<22} {med[lossy]:>9.2f} {med[lossy] / med[exact]:>8.2f}x")
    print("\n".join(lines))
    res = {"config": args.config, "reps": args.reps, "median_s": med, "runs_s": runs,
           "ratios": {lossy: med[lossy] / med[exact] for exact, lossy in PAIRS},
           "machine": {**machine(), "load_average": list(os.getloadavg())}}
    print(json.dumps(res, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
