"""Per-rank memory plan of the published model (its GGUF header's inventory, no weights):
what each of N ranks (Macs under ``mlx.launch``) needs in each precision, by stored form.

    python benchmarks/rank_plan.py [--ranks 2] [--gpu/--cpu]

Prints a table, then the JSON. Priced as ``mlx-dgemma plan MODEL --ranks N`` prices it
(``mlx_dgemma.plan.make_plan``), with the activation dtype of a Mac's GPU (bfloat16) by default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from full_size import HEADER, load_header, vocab_size  # noqa: E402

from mlx_dgemma.convert.metadata import args_from_metadata  # noqa: E402
from mlx_dgemma.convert.names import mlx_name, module_path  # noqa: E402
from mlx_dgemma.plan import make_plan  # noqa: E402
from mlx_dgemma.tiers import TensorInfo  # noqa: E402

FORMS = ("exact", "fast", "q4", "gguf")  # a converted directory's precision, or the .gguf itself


def inventory(header: dict) -> list[TensorInfo]:
    out = []
    for t in header["tensors"]:
        p = mlx_name(t["name"])
        out.append(TensorInfo(p if t["type"] in ("F32", "F16", "BF16") else module_path(p), tuple(reversed(t["ne"])),
                              t["type"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="float32 activations (MLX's CPU backend) instead of bfloat16")
    a = ap.parse_args()
    header = load_header(HEADER)
    args, inv = args_from_metadata(header["metadata"], vocab_size(header)), inventory(header)
    rows = []
    for stored in FORMS:
        for ranks in sorted({1, a.ranks}):
            plans = [make_plan("published", args, inv, stored, memory_limit=1 << 50, gpu=not a.cpu, ranks=ranks,
                               rank=r) for r in range(ranks)]
            plan = max(plans, key=lambda p: p.row("exact").needed_bytes)  # the largest share
            for r in plan.rows:
                if (r.loadable or r.split_refused) and r.precision != "q3":
                    rows.append({"stored": stored, "ranks": ranks, "precision": r.precision,
                                 "weights_gb": round(r.weights_bytes / 1e9, 2), "kv_gb": round(r.kv_bytes / 1e9, 2),
                                 "working_gb": round(r.working_bytes / 1e9, 2),
                                 "load_peak_gb": round(r.load_peak_bytes / 1e9, 2),
                                 "needed_gb": round(r.needed_bytes / 1e9, 2), "split_refused": r.split_refused})
    print(f"{'stored':<8}{'ranks':>6}  {'precision':<10}{'weights':>9}{'KV':>7}{'working':>9}{'load peak':>11}"
          f"{'needed/rank':>13}   (GB; KV cache for {plans[0].context_tokens} tokens)")
    for r in rows:
        print(f"{r['stored']:<8}{r['ranks']:>6}  {r['precision']:<10}{r['weights_gb']:>9.2f}{r['kv_gb']:>7.2f}"
              f"{r['working_gb']:>9.2f}{r['load_peak_gb']:>11.2f}{r['needed_gb']:>13.2f}"
              + ("   refused: the split cuts its groups" if r["split_refused"] else ""))
    print(json.dumps({"activations": "float32" if a.cpu else "bfloat16", "rows": rows}))


if __name__ == "__main__":
    main()
