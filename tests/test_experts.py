"""The experts' token sort (the gather/scatter helpers vendored from mlx-lm) changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from mlx_dgemma import model as model_mod
from mlx_dgemma.switch_layers import gather_sort, scatter_unsort


def test_sorted_and_unsorted_expert_dispatch_agree(monkeypatch):
    mx.random.seed(0)
    args = SimpleNamespace(num_experts=8, hidden_size=16, moe_intermediate_size=8)
    experts = model_mod.Experts(args)
    x = mx.random.normal((3, 11, 16))
    idx = mx.random.randint(0, 8, (3, 11, 4))  # 132 token-expert pairs: above the sort threshold
    weights = mx.softmax(mx.random.normal((3, 11, 4)), axis=-1)
    assert idx.size >= model_mod._SORT_THRESHOLD
    sorted_out = experts(x, idx, weights)
    monkeypatch.setattr(model_mod, "_SORT_THRESHOLD", 10**9)
    plain = experts(x, idx, weights)
    assert sorted_out.shape == x.shape
    np.testing.assert_allclose(np.array(sorted_out), np.array(plain), rtol=1e-5, atol=1e-5)


def test_gather_sort_round_trip():
    x = mx.arange(5 * 16, dtype=mx.float32).reshape(5, 1, 1, 16)
    idx = mx.array([[3, 1], [0, 3], [2, 2], [1, 0], [3, 0]])
    rows, ids, inv = gather_sort(x, idx)
    assert np.all(np.diff(np.array(ids)) >= 0)  # grouped by expert
    # Each sorted row is the token that chose that expert; unsorting restores token order.
    back = np.array(scatter_unsort(rows, inv, idx.shape))  # [5, 2, 1, 16]
    expected = np.repeat(np.array(x)[:, None, 0], 2, axis=1)
    np.testing.assert_array_equal(back, expected)
