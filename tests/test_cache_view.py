"""A decoder pass reads only the KV cache's filled slots (rounded up), not a global layer's
whole 1024-slot bucket: the same logits to the bit, a fraction of the attention work."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma.cache import view_length
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import StepFunction


def test_view_length_covers_the_filled_slots_with_little_waste():
    lengths = set()
    for filled in range(0, 5000):
        n = view_length(filled, 4096, 64)
        assert filled <= n <= 4096 or (filled > 4096 and n == 4096)
        if filled < 4096:
            assert n - filled <= max(64, filled // 4)  # at most a granule or a quarter empty
        lengths.add(n)
    # one trace per length: one per 64 slots up to 512, then 4 per doubling (512 -> 4096: 12)
    assert len(lengths) == 8 + 12
    assert view_length(27, 1024, 64) == 64 and view_length(91, 127, 64) == 127 and view_length(512, 1024, 256) == 512


@pytest.fixture(scope="module")
def demo():
    from mlx_dgemma import load
    from mlx_dgemma.demo import trained_demo_path

    return load(str(trained_demo_path()), precision="exact")


def _step(rt, cache, canvas, sc):
    p = SamplerParams.from_config(rt.generation_config)
    fn = StepFunction(rt.model, p, rt.activation_dtype)  # a fresh trace each call: the views differ
    out = fn(canvas, sc, 0.2, mx.random.key(0), fn.initial_history(canvas.shape), cache)
    mx.eval(out)
    return out


def test_step_reads_only_filled_slots_and_gives_the_same_logits(demo):
    model, tok = demo.model, demo.tokenizer
    C = model.args.canvas_length
    cache = model.make_cache()
    model.prefill(mx.array([tok.encode("In the beginning God created the heaven and the earth.")]), cache)
    filled = cache.offset
    globals_ = [c for c in cache.layers if not c.sliding]
    assert globals_ and all(c.capacity == 1024 for c in globals_)  # the bucket the old pass read whole
    assert 0 < filled < C
    # a short prompt: every layer's view is one granule (the canvas length), not 1024 (or 127) slots
    assert [a.shape[2] for a in cache.step_state() if a.ndim == 4] == [C] * 2 * len(cache.layers)

    canvas = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (1, C)), dtype=mx.int32)
    sc = model.denoise(canvas, cache) / 0.2
    trimmed = _step(demo, cache, canvas, sc)
    for c in cache.layers:  # the old view: every slot of every bucket
        c.granule = 1 << 30
    assert all(a.shape[2] == 1024 for a in cache.step_state() if a.ndim == 4 and a.shape[2] > 127)
    whole = _step(demo, cache, canvas, sc)
    # masked slots add exact zeros: bit-identical, logits and draws
    for name in ("processed", "argmax", "canvas", "entropy"):
        assert np.array_equal(np.array(trimmed[name]), np.array(whole[name])), name
