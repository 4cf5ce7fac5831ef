"""Reduced-precision compute modes: measured logit error against float32, and weights that
stay quantized in memory (no dequantized expert or embedding copies)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma.loader import load_dir

# Max |err| / max |logit| measured on the tiny Q4_K_M model (3 layers, logits up to ~25):
# bfloat16 ~0.08 (step 1) / ~0.13 (self-conditioned step); float16 ~0.010 / ~0.010.
BOUNDS = {mx.bfloat16: 0.25, mx.float16: 0.03}


def run(model, dtype, prompt, canvas, sc):
    cache = model.make_cache()
    model.prefill(prompt, cache, dtype=dtype)
    a = model.denoise(canvas, cache, dtype=dtype)
    b = model.denoise(canvas, cache, sc, dtype=dtype)
    return np.array(a), np.array(b)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    return mx.array(rng.integers(0, 512, (1, 40))), mx.array(rng.integers(0, 512, (1, 32)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
def test_reduced_precision_error(tiny_model_dir, inputs, dtype):
    prompt, canvas = inputs
    ref_model, _ = load_dir(tiny_model_dir)
    r1, _ = run(ref_model, mx.float32, prompt, canvas, None)
    sc = mx.array(r1)
    r1, r2 = run(ref_model, mx.float32, prompt, canvas, sc)
    model, _ = load_dir(tiny_model_dir, dtype=dtype)
    a1, a2 = run(model, dtype, prompt, canvas, sc)
    e1 = np.abs(a1 - r1).max() / np.abs(r1).max()
    e2 = np.abs(a2 - r2).max() / np.abs(r2).max()
    top1 = (a1.argmax(-1) == r1.argmax(-1)).mean()
    print(f"{dtype}: max rel logit error {e1:.3g} (step 1), {e2:.3g} (self-conditioned); top-1 agree {top1:.2f}")
    assert a1.dtype == np.float32
    assert 0 < e1 <= BOUNDS[dtype] and 0 < e2 <= BOUNDS[dtype]
    assert top1 >= 0.9


def test_weights_stay_quantized(tiny_model_dir):
    model, config = load_dir(tiny_model_dir)
    params = dict(tree_flatten(model.parameters()))
    for path, spec in config["quantization"].items():
        if isinstance(spec, dict):
            assert params[f"{path}.weight"].dtype == mx.uint32, path
    assert params["embed_tokens.weight"].dtype == mx.uint32
    assert params["layers.0.experts.gate_up_proj.weight"].dtype == mx.uint32
    stored = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    in_memory = sum(v.nbytes for v in params.values())
    assert in_memory <= stored  # nothing expanded at load time
