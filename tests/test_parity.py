"""Live parity against the Hugging Face reference on tiny random configs (float32).

The weights go GGUF -> convert -> load (K-quants included); the HF model holds the same
dequantized values. Tolerance: max |ours - ref| / max |ref| <= 1e-4 on the logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from mlx_dgemma.loader import load_dir

from .hf_reference import HFRunner, hf_model_from_gguf

pytestmark = pytest.mark.parity
TOL = 1e-4


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    gguf = write_tiny_gguf(d / "tiny.gguf", TinySpec(), types="q4_k_m", seed=3)
    convert(gguf, d / "mlx")
    model, _ = load_dir(d / "mlx")
    return model, hf_model_from_gguf(gguf)


def run_case(pair, prompt_len: int, blocks: int, with_sc: bool, seed: int = 0):
    model, hf = pair
    rng = np.random.default_rng(seed)
    V, C = model.args.vocab_size, model.args.canvas_length
    ref_run = HFRunner(hf)
    cache = model.make_cache()
    prompt = rng.integers(0, V, (1, prompt_len))
    model.prefill(mx.array(prompt), cache)
    ref_run.prefill(prompt)
    errs = []
    for b in range(blocks):
        canvas = rng.integers(0, V, (1, C))
        sc = (rng.normal(0, 3, (1, C, V)).astype(np.float32)) if with_sc else None
        ours = model.denoise(mx.array(canvas), cache, None if sc is None else mx.array(sc))
        ref = ref_run.denoise(canvas, sc)
        assert np.abs(ref).max() > 5  # logits are large enough for the softcap to matter
        errs.append(rel_err(ours, ref))
        # second step of the same block: both sides self-condition on the reference's logits
        ours2 = model.denoise(mx.array(canvas), cache, mx.array(ref))
        ref2 = ref_run.denoise(canvas, ref)
        errs.append(rel_err(ours2, ref2))
        # commit the argmax canvas through the encoder, then the next block
        committed = ref.argmax(-1)
        model.prefill(mx.array(committed), cache)
        ref_run.prefill(committed)
    return errs


@pytest.mark.parametrize("prompt_len,blocks,with_sc", [
    (5, 1, False),     # short prompt
    (5, 1, True),      # with self-conditioning logits
    (40, 1, False),    # prompt longer than the sliding window (16)
    (40, 2, True),     # two blocks: decode, commit through the encoder, decode the next
])
def test_logits_match_reference(pair, prompt_len, blocks, with_sc):
    errs = run_case(pair, prompt_len, blocks, with_sc)
    print(f"parity prompt={prompt_len} blocks={blocks} sc={with_sc}: max rel err {max(errs):.2e} {errs}")
    assert max(errs) <= TOL


def test_every_ggml_type_matches_reference(all_types_gguf, all_types_model_dir):
    """Q2_K/Q3_K/Q6_K (padded sub-blocks), Q4_K/Q5_K, legacy types, F16 and BF16 in the forward pass."""
    model, _ = load_dir(all_types_model_dir)
    errs = run_case((model, hf_model_from_gguf(all_types_gguf)), prompt_len=20, blocks=2, with_sc=True, seed=5)
    print(f"parity all ggml types: max rel err {max(errs):.2e}")
    assert max(errs) <= TOL
