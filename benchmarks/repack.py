"""The down-projection experts at 5 vs 8 bits: what fast's lossless repack of Q5_0/Q5_1 weights
(:func:`mlx_dgemma.tiers.repack_bits`) buys, at the published shapes.

    python benchmarks/repack.py [--tokens 256] [--experts 128] [--top-k 8] [--dtypes float32,bfloat16]
                                [--runs 5] [--json FILE]

The published file stores 16 of its 30 layers' ``ffn_down_exps`` as Q5_0: [128 experts, hidden
2816, expert width 704], in MLX 5-bit affine groups of 32 (scale d, bias -16 d). The same
integers in 8-bit groups of 32 with the same scales and biases dequantize to the same values
bit for bit. Each row times ``mx.gather_qmm`` (what :class:`QuantizedSwitchLinear` calls) on a
canvas of ``--tokens`` positions, each routed to ``--top-k`` of the experts (rows sorted by
expert, as the model sorts them), in the activation dtype (scales and biases in it too, as
fast holds them): the median of ``--runs`` after a warm-up, the two forms taking turns run
by run (a shared machine slows both alike), and the outputs' largest difference (0 expected:
the same values, summed in the same order by kernels of different bit widths need not be).
This measures the default device (the CPU backend here); it does not predict a GPU's figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_dgemma.tiers import pack_bits

HIDDEN, WIDTH, EXPERTS = 2816, 704, 128  # ffn_down_exps of the published GGUF (reference header)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def q5_0_experts(experts: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random Q5_0-shaped experts: integers 0..31 [E, HIDDEN, WIDTH], float16 scales d ~ the
    published magnitude and biases -16 d [E, HIDDEN, WIDTH / 32]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 32, (experts, HIDDEN, WIDTH), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (experts, HIDDEN, WIDTH // 32)) * 1e-3).astype(np.float16)
    return q, d, (-16 * d.astype(np.float32)).astype(np.float16)


def measure(fns: dict, runs: int) -> dict[str, tuple[float, mx.array]]:
    for fn in fns.values():
        mx.eval(fn())  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs = {}
    for _ in range(runs):
        for name, fn in fns.items():
            mx.synchronize()
            t0 = time.perf_counter()
            out = fn()
            mx.eval(out)
            times[name].append(time.perf_counter() - t0)
            outs[name] = out
    return {k: (statistics.median(v), outs[k]) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="canvas positions (default 256, the published canvas)")
    ap.add_argument("--experts", type=int, default=EXPERTS, help="experts in the stack (default 128)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per position (default 8)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes (fast: float32 on the CPU, "
                    "bfloat16 on a GPU)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()

    q, d, m = q5_0_experts(a.experts)
    forms = {bits: mx.array(pack_bits(q, bits)) for bits in (5, 8)}
    rng = np.random.default_rng(1)
    ids = np.sort(np.stack([rng.choice(a.experts, a.top_k, replace=False) for _ in range(a.tokens)]).reshape(-1))
    idx = mx.array(ids.astype(np.uint32))
    flop = 2 * ids.size * HIDDEN * WIDTH
    print(f"MLX {mx.__version__}, {mx.default_device()}, {platform.machine()}; down experts [{a.experts}, {HIDDEN}, "
          f"{WIDTH}], {a.tokens} positions x top-{a.top_k} = {ids.size} rows (sorted), groups of 32; "
          f"median of {a.runs}", flush=True)
    print(f"  {'dtype':<10}{'5-bit ms':>10}{'8-bit ms':>10}{'8/5':>7}{'5-bit GFLOP/s':>15}{'8-bit GFLOP/s':>15}"
          f"{'max |diff|':>12}", flush=True)
    rows = []
    for name in a.dtypes.split(","):
        dt = DTYPES[name]
        s, b = mx.array(d).astype(dt), mx.array(m).astype(dt)
        x = (mx.random.normal((ids.size, 1, WIDTH), key=mx.random.key(2)) * 0.1).astype(dt)
        mx.eval(s, b, x, *forms.values())
        fns = {bits: (lambda w=w, bits=bits, x=x, s=s, b=b: mx.gather_qmm(
            x, w, s, b, rhs_indices=idx, transpose=True, group_size=32, bits=bits, sorted_indices=True))
            for bits, w in forms.items()}
        r = measure(fns, a.runs)
        diff = float(mx.abs(r[5][1].astype(mx.float32) - r[8][1].astype(mx.float32)).max())
        t5, t8 = r[5][0], r[8][0]
        rows.append({"dtype": name, "ms_5bit": t5 * 1e3, "ms_8bit": t8 * 1e3, "ratio_8_over_5": t8 / t5,
                     "gflops_5bit": flop / t5 / 1e9, "gflops_8bit": flop / t8 / 1e9, "max_abs_diff": diff})
        print(f"  {name:<10}{t5 * 1e3:>10.1f}{t8 * 1e3:>10.1f}{t8 / t5:>7.2f}{flop / t5 / 1e9:>15.1f}"
              f"{flop / t8 / 1e9:>15.1f}{diff:>12.2g}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
                       "shape": [a.experts, HIDDEN, WIDTH], "tokens": a.tokens, "top_k": a.top_k, "runs": a.runs,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
