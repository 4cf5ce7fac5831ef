"""The FLOP model of one denoising step, and the ceiling it is compared with: MLX's own dense
matmul throughput on this machine."""

from __future__ import annotations

import statistics
from typing import Any

import mlx.core as mx

from .timing import sync_time


def step_flops(a: Any, canvas: int, cache_len: int, sc: bool = True) -> float:
    """Multiply-adds x 2 of one decoder step (projections, attention, MLPs, experts, head, SC)
    for model args ``a`` with ``cache_len`` cached positions."""
    C, H = canvas, a.hidden_size
    total = 0.0
    for i in range(a.num_hidden_layers):
        sliding = a.is_sliding(i)
        hd = a.head_dim if sliding else a.global_head_dim
        kv = a.num_key_value_heads if sliding else a.num_global_key_value_heads
        q, k = a.num_attention_heads * hd, kv * hd
        keys = min(cache_len, a.sliding_window - 1) + C if sliding else cache_len + C
        total += 2 * C * H * (q + k * (2 if sliding else 1)) + 2 * C * q * H  # q, k, v, o
        total += 2 * 2 * C * a.num_attention_heads * keys * hd  # scores and weighted sum
        total += 2 * C * 3 * H * a.intermediate_size  # dense gated MLP
        total += 2 * C * H * a.num_experts  # router
        total += 2 * C * a.top_k_experts * 3 * H * a.moe_intermediate_size  # experts
    total += 2 * C * H * a.vocab_size  # tied output head
    if sc:
        total += 2 * C * H * a.vocab_size + 2 * C * 3 * H * a.intermediate_size  # probs @ E, SC MLP
    return total


def dense_matmul_gflops(dtype: mx.Dtype, M: int = 256, K: int = 2048, N: int = 2048) -> float:
    """MLX's own dense matmul throughput on this machine (the ceiling for our FLOP/s)."""
    x = mx.random.normal((M, K)).astype(dtype)
    w = mx.random.normal((N, K)).astype(dtype)
    t = statistics.median(sync_time(lambda: x @ w.T, 1, 3))
    return 2 * M * K * N / t / 1e9
