"""`fast`'s sparse self-conditioning selects each position's top-k tokens without a full sort
of the vocabulary (issue 30, item 5: MLX runs argpartition as a full sort on Metal and CUDA):
``model.top_k_indices`` takes the same set as ``argpartition`` in two stages."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import model as model_mod
from mlx_dgemma.model import top_k_indices


def _reference(x: mx.array, k: int) -> np.ndarray:
    return np.sort(np.array(mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]), axis=-1)


@pytest.mark.parametrize("shape, k, chunk", [
    ((2, 16, 16384), 64, None),  # 8 chunks of the default 2,048: two stages
    ((1, 5, 8192), 1, None),  # the smallest k
    ((3, 7, 640), 16, 64),  # the demo's vocabulary in chunks of 64
    ((4, 256), 4, 16),  # 2-D rows
])
def test_two_stages_select_the_same_set_as_argpartition(shape, k, chunk):
    rng = np.random.default_rng(sum(shape) + k)
    logits = rng.standard_normal(shape).astype(np.float32) * 3
    x = mx.softmax(mx.array(logits), axis=-1)
    got = np.array(top_k_indices(x, k, chunk))
    assert got.shape == shape[:-1] + (k,)
    np.testing.assert_array_equal(np.sort(got, axis=-1), _reference(x, k))


def test_a_rows_whole_top_k_in_one_chunk_is_found():
    # the adversarial case for a chunked selection: every one of the top k sits in one chunk
    x = np.zeros((2, 16384), np.float32)
    x[0, 4096:4096 + 64] = np.linspace(1, 2, 64)
    x[1, -64:] = np.linspace(1, 2, 64)
    got = np.sort(np.array(top_k_indices(mx.array(x), 64)), axis=-1)
    np.testing.assert_array_equal(got[0], np.arange(4096, 4096 + 64))
    np.testing.assert_array_equal(got[1], np.arange(16384 - 64, 16384))


def test_ties_select_values_as_large_as_argpartitions():
    # probabilities rounded to a few levels: many ties at the k-th value; whichever tied ids are
    # chosen, the selected values (what self-conditioning weighs) are the same multiset
    rng = np.random.default_rng(7)
    x = mx.array(np.round(rng.random((4, 16384)) * 20).astype(np.float32))
    got = top_k_indices(x, 64)
    ref = mx.argpartition(-x, kth=63, axis=-1)[..., :64]
    np.testing.assert_array_equal(np.sort(np.array(mx.take_along_axis(x, got, axis=-1)), axis=-1),
                                  np.sort(np.array(mx.take_along_axis(x, ref, axis=-1)), axis=-1))
    assert all(len(set(r)) == 64 for r in np.array(got).tolist())  # no id twice


@pytest.mark.parametrize("shape, k, chunk", [((2, 1000), 8, 64), ((2, 192), 8, 64), ((2, 4096), 300, 1024)])
def test_rows_that_do_not_split_take_one_argpartition(shape, k, chunk):
    # not whole chunks, fewer than four, or k above a quarter of a chunk: today's argpartition
    x = mx.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    np.testing.assert_array_equal(np.array(top_k_indices(x, k, chunk)),
                                  np.array(mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]))


def test_soft_embeddings_are_the_same_in_two_stages(monkeypatch):
    # the trained demo's self-conditioning input from top-16, with its 640-token vocabulary cut
    # into chunks of 64 (two stages) and whole (one argpartition): the same embeddings
    from mlx_dgemma import load_demo

    model = load_demo(precision="exact").model
    V = model.args.vocab_size
    logits = mx.array(np.random.default_rng(3).standard_normal((1, 64, V)).astype(np.float32) * 4)
    whole = model.soft_embeddings(logits, mx.float32, top_k=16)
    monkeypatch.setattr(model_mod, "TOP_K_CHUNK", 64)
    assert V % 64 == 0 and V // 64 >= 4
    chunked = model.soft_embeddings(logits, mx.float32, top_k=16)
    np.testing.assert_allclose(np.array(chunked), np.array(whole), rtol=1e-5, atol=1e-6)
