"""Kernel timings behind the fast precision on MLX's CUDA backend (prints as it goes).

The output head / self-conditioning product of the real shapes (canvas 256, hidden 2816,
vocab 262144) with the weight forms the precisions use: fast (8-bit group 32, bfloat16
scales), mlx-vlm stock (4-bit group 64, bfloat16), exact (padded 6-bit, float32 scales).
"""

import time

import mlx.core as mx


def timed(label, fn, n=10):
    t0 = time.perf_counter()
    mx.eval(fn())
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    print(f"{label:<52} {(time.perf_counter() - t0) / n * 1e3:8.2f} ms  (first call {first:.1f} s)", flush=True)


M, K, N = 256, 2816, 262144
x = mx.random.normal((M, K)).astype(mx.bfloat16) * 0.1
w = mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02
mx.eval(x, w)
print(mx.__version__, mx.default_device(), flush=True)
for bits, gs in ((8, 32), (4, 32), (4, 64)):
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(q, s, b)
    timed(f"head x @ W^T  bf16, {bits}-bit g{gs}", lambda: mx.quantized_matmul(x, q, s, b, transpose=True,
                                                                              group_size=gs, bits=bits))
