"""Sparse self-conditioning's selection: each canvas position's top-k tokens out of the whole
vocabulary, at the published shapes (canvas 256, vocabulary 262,144, k = 64: `fast`'s).

    python benchmarks/sc_select.py [--runs 5] [--canvas 256] [--vocab 262144] [--k 64] [--json FILE]

Three ways, each on the default device (and on MLX's CPU stream where that is a GPU):

* ``argpartition``: ``mx.argpartition(-p, k - 1)[..., :k]``, what `fast` ran before. On the CPU
  a selection (``nth_element``); on Metal and CUDA MLX runs every partition as a full sort
  (``mlx/backend/metal/sort.cpp``: "We direct arg partition to sort for now").
* ``sort``: ``mx.argsort(-p)[..., :k]``, a full sort: what the GPUs run for the line above.
* ``two-stage``: :func:`mlx_dgemma.model.top_k_indices`, the top k of each 2,048-entry chunk,
  then the top k of those candidates; the same set.

Each row: the median time of ``--runs`` evaluations (after one warm-up; the ways take turns
run by run) and the peak memory above the probabilities themselves (MLX's own count, reset
before each run). The table ends
with the transient memory of Metal's multi-block sort for this shape, computed from MLX's
source (two copies of the values, two of the indices, the output, the block partitions),
which a CPU cannot measure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_dgemma.model import TOP_K_CHUNK, top_k_indices


def ways(k: int) -> dict:
    return {
        "argpartition": lambda p: mx.argpartition(-p, kth=k - 1, axis=-1)[..., :k],
        "sort": lambda p: mx.argsort(-p, axis=-1)[..., :k],
        "two-stage": lambda p: top_k_indices(p, k),
    }


def measure(fns: dict, p: mx.array, runs: int) -> dict[str, tuple[float, int, np.ndarray]]:
    """Each way: (median seconds, peak bytes above ``p``, the selected ids sorted per row). The
    ways take turns run by run, so a machine shared with other work slows them alike."""
    for fn in fns.values():
        mx.eval(fn(p))  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    peaks: dict[str, list[int]] = {k: [] for k in fns}
    ids: dict[str, np.ndarray] = {}
    for _ in range(runs):
        for name, fn in fns.items():
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            sel = fn(p)
            weights = mx.take_along_axis(p, sel, axis=-1)  # the probabilities the embedding rows are weighted by
            mx.eval(sel, weights)
            times[name].append(time.perf_counter() - t0)
            peaks[name].append(mx.get_peak_memory() - base)
            ids[name] = np.sort(np.array(sel), axis=-1)
            del sel, weights
    return {k: (statistics.median(times[k]), max(peaks[k]), ids[k]) for k in fns}


def metal_sort_bytes(rows: int, vocab: int) -> int:
    """Transient bytes of MLX's Metal argsort of ``rows`` float32 rows of ``vocab`` entries
    (``multi_block_sort``: dev_vals_0/1, dev_idxs_0/1 (uint32), block_partitions, the output)."""
    n_per_block = 512 * 4  # bn 512, tn 4 for rows longer than 1,024
    blocks = -(-vocab // n_per_block)
    return rows * vocab * 4 * 5 + rows * (blocks + 1) * 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # logits spread like a model's (a few strong candidates over a flat tail), as probabilities
    logits = rng.standard_normal((1, args.canvas, args.vocab)).astype(np.float32) * 2.0
    logits[..., rng.integers(0, args.vocab, 32)] += 8.0
    devices = [("default", mx.default_device())] + ([("cpu", mx.cpu)] if mx.default_device() != mx.cpu else [])
    rows = []
    for dev_name, dev in devices:
        with mx.stream(dev):
            p = mx.softmax(mx.array(logits), axis=-1)
            mx.eval(p)
            results = measure(ways(args.k), p, args.runs)
            ref = results["argpartition"][2]
            for name, (sec, peak, ids) in results.items():
                rows.append({"device": f"{dev_name} ({dev})", "way": name, "seconds": sec, "peak_bytes": peak,
                             "same_set_as_argpartition": bool(np.array_equal(ids, ref))})
            del p
    info = {"machine": f"{platform.system()} {platform.machine()}", "mlx": mx.__version__,
            "shape": [1, args.canvas, args.vocab], "k": args.k, "chunk": TOP_K_CHUNK, "runs": args.runs,
            "metal_sort_transient_bytes": metal_sort_bytes(args.canvas, args.vocab), "rows": rows}
    print(f"{info['machine']}, MLX {info['mlx']}: probabilities [1, {args.canvas}, {args.vocab}] float32 "
          f"({args.canvas * args.vocab * 4 / 1e9:.2f} GB), top {args.k}, median of {args.runs}")
    print(f"{'device':<22} {'way':<13} {'seconds':>9} {'peak above p':>13}  same set")
    for r in rows:
        print(f"{r['device']:<22} {r['way']:<13} {r['seconds']:>9.4f} {r['peak_bytes'] / 1e9:>10.3f} GB  "
              f"{'yes' if r['same_set_as_argpartition'] else 'NO'}")
    print(f"Metal's argpartition (a multi-block merge sort), from MLX's source: "
          f"{info['metal_sort_transient_bytes'] / 1e9:.2f} GB transient")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
