"""What loading ``fast`` from an exact directory adds to loading it exact, at any size: the
padded sub-block tensors (Q6_K and the like: the embedding, some attention and down projections)
read from the directory and re-quantized to fast's 8-bit groups the way the loader does
(``tiers.requantize_stored`` over slices of the leading axis, on ``tiers.ordered_map``'s threads),
holding only those tensors: at full size 1.6 GB of the exact form's 21.4, so it runs where
loading the whole exact form does not fit. Prints JSON.

    python benchmarks/fast_requantize.py EXACT_DIR [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dgemma.schema import QuantSpec
from mlx_dgemma.tiers import PADDED_TYPES, ordered_map, requantize_stored, target, workers
from mlx_dgemma.validate import check_model_dir, model_dir_shards


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=None, help="re-quantizer threads (default: the processors)")
    a = ap.parse_args(argv)
    config = check_model_dir(a.model_dir)
    layers = config["text_config"]["num_hidden_layers"]
    specs = {k: QuantSpec.from_dict(v) for k, v in config["quantization"].items() if isinstance(v, dict)}
    padded = {k: s for k, s in specs.items() if s.ggml_type in PADDED_TYPES and s.subblock == 16}
    t0, c0 = time.perf_counter(), time.process_time()
    arrays: dict[str, mx.array] = {}
    for f in model_dir_shards(a.model_dir):
        for name, arr in mx.load(str(f)).items():
            if name.rsplit(".", 1)[0] in padded:
                arrays[name] = arr
    mx.eval(list(arrays.values()))
    read = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "bytes": sum(v.nbytes for v in arrays.values())}
    jobs = []
    weights = 0
    for module, spec in padded.items():
        w, s, b = (np.asarray(arrays[f"{module}.{k}"]) for k in ("weight", "scales", "biases"))
        n = w.shape[-1] * 32 // spec.bits // 2
        goal = target("fast", module, spec.ggml_type, layers, n)
        weights += int(np.prod(w.shape[:-1])) * n
        step = max(1, (1 << 20) // max(1, w[0].size * 32 // spec.bits))  # as the loader slices
        jobs += [(w[i:i + step], s[i:i + step], b[i:i + step], spec, goal) for i in range(0, w.shape[0], step)]
    threads = a.threads or workers()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in ordered_map(lambda j: requantize_stored(j[0], j[1], j[2], j[3].bits, j[3].group_size, 16, j[4]),
                         jobs, threads):
        pass
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"model_dir": str(a.model_dir), "tensors": len(padded), "weights": weights, "read": read,
                      "requantize": {"threads": threads, "seconds": wall, "cpu_seconds": cpu,
                                     "weights_per_second": weights / wall,
                                     "cpu_ns_per_weight": cpu / weights * 1e9}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
