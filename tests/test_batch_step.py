"""benchmarks/batch_step.py measures a real batch: B sequences with prompts of different lengths,
their caches stacked (padded, each with its own slot positions and RoPE offset), give through
one decoder pass and one compiled step what each gives alone. Its timings are not a test."""


import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import load
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import StepFunction
from tests.scripts import load_script

# a prompt shorter than the sliding window (empty ring slots), one longer, and one past the
# global layer's first bucket of 1024 slots (the others are padded to its capacity)
LENGTHS = (5, 40, 1030)


@pytest.fixture(scope="module")
def bs():
    return load_script("benchmarks/batch_step.py")


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    rt = load(tiny_model_dir, precision="exact")
    model = rt.model
    a = model.args
    rng = np.random.default_rng(0)
    caches = []
    for n in LENGTHS:
        c = model.make_cache()
        model.prefill(mx.array(rng.integers(0, a.vocab_size, (1, n)), dtype=mx.int32), c)
        caches.append(c)
    canvases = [mx.array(rng.integers(0, a.vocab_size, (1, a.canvas_length)), dtype=mx.int32) for _ in LENGTHS]
    return model, caches, canvases, rt


def test_the_batch_pads_a_cache(bs, batch):
    _, caches, _, _ = batch
    capacities = {c[i].capacity for c in caches for i in range(len(c.layers)) if not c[i].sliding}
    assert len(capacities) == 2, capacities  # the padding path is exercised
    stacked = bs.StackedCache(caches)
    assert stacked.offset.tolist() == list(LENGTHS)


def test_stacked_logits_equal_each_sequence_alone(bs, batch):
    model, caches, canvases, rt = batch
    alone = [model.denoise(cv, c) for cv, c in zip(canvases, caches)]
    together = model.denoise(mx.concatenate(canvases), bs.StackedCache(caches))
    scale = max(float(mx.abs(x).max()) for x in alone)
    for i, x in enumerate(alone):
        np.testing.assert_allclose(np.array(together[i:i + 1]), np.array(x), rtol=0, atol=1e-5 * scale,
                                   err_msg=f"sequence {i} ({LENGTHS[i]} prompt tokens)")


def test_the_compiled_step_over_the_batch_equals_each_alone(bs, batch):
    model, caches, canvases, rt = batch
    params = SamplerParams.from_config(rt.generation_config)
    C = model.args.canvas_length
    alone_step = StepFunction(model, params, rt.activation_dtype)
    alone = [alone_step(cv, None, 0.3, mx.random.key(0), alone_step.initial_history((1, C)), c)
             for cv, c in zip(canvases, caches)]
    batch_step = StepFunction(model, params, rt.activation_dtype)
    out = batch_step(mx.concatenate(canvases), None, 0.3, mx.random.key(0),
                     batch_step.initial_history((len(LENGTHS), C)), bs.StackedCache(caches))
    for i, o in enumerate(alone):
        assert np.array_equal(np.array(out["argmax"][i]), np.array(o["argmax"][0])), f"sequence {i}"
        np.testing.assert_allclose(np.array(out["entropy"][i]), np.array(o["entropy"][0]), rtol=1e-5, atol=1e-6)
