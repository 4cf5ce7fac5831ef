"""Chunked prefill: equal to one pass and to the Hugging Face reference on prompts longer
than the sliding window (16 on the tiny config) and several chunks long; resumable between
chunks; the compiled step keeps its trace; attention split by query blocks is exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import load_dir
from mlx_dgemma.model import bounded_attention
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import StepFunction

TOL = 1e-4
PROMPT = 90  # > 5 windows of 16; 7 chunks of 13


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref)
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def gguf_and_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill")
    # a global layer before the last: the last layer only stores keys and values, the
    # others attend, so chunked global attention is checked too
    gguf = write_tiny_gguf(d / "tiny.gguf", TinySpec(num_layers=4, global_layers=(1, 3)), types="q4_k_m", seed=7)
    convert(gguf, d / "mlx")
    model, _ = load_dir(d / "mlx")
    return gguf, model


def _prompt(model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, (1, n))


def _filled(cache) -> list[np.ndarray]:
    """Every layer's filled slots as (positions, keys, values), ordered by position."""
    out = []
    for layer in cache.layers:
        pos = np.array(layer.pos)
        idx = np.argsort(np.where(pos < 0, np.iinfo(np.int32).max, pos))[: int((pos >= 0).sum())]
        out.append((pos[idx], np.array(layer.keys)[:, :, idx], np.array(layer.values)[:, :, idx]))
    return out


@pytest.mark.parametrize("chunk", [1, 13, 16, 40])
def test_chunked_cache_and_logits_equal_one_pass(gguf_and_model, chunk):
    _, model = gguf_and_model
    prompt = mx.array(_prompt(model, PROMPT))
    one, chunked = model.make_cache(), model.make_cache()
    model.prefill(prompt, one, chunk_size=None)
    model.prefill(prompt, chunked, chunk_size=chunk)
    assert chunked.offset == one.offset == PROMPT
    for (p1, k1, v1), (p2, k2, v2) in zip(_filled(one), _filled(chunked)):
        np.testing.assert_array_equal(p1, p2)  # same positions kept (ring: the last window - 1)
        assert rel_err(k2, k1) <= TOL and rel_err(v2, v1) <= TOL
    canvas = mx.array(_prompt(model, model.args.canvas_length, seed=1))
    assert rel_err(model.denoise(canvas, chunked), model.denoise(canvas, one)) <= TOL


def test_chunked_prefill_matches_reference(gguf_and_model):
    """Chunked prompt, a decoded block, the block committed in chunks, the next block: vs HF."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5.23")
    from mlx_dgemma.bench.peers import HFRunner, hf_model_from_gguf

    gguf, model = gguf_and_model
    ref = HFRunner(hf_model_from_gguf(gguf))
    prompt = _prompt(model, PROMPT)
    cache = model.make_cache()
    model.prefill(mx.array(prompt), cache, chunk_size=13)
    ref.prefill(prompt)
    rng = np.random.default_rng(2)
    for _ in range(2):
        canvas = rng.integers(0, model.args.vocab_size, (1, model.args.canvas_length))
        want = ref.denoise(canvas)
        assert np.abs(want).max() > 5  # logits large enough for the softcap to matter
        assert rel_err(model.denoise(mx.array(canvas), cache), want) <= TOL
        committed = want.argmax(-1)
        model.prefill(mx.array(committed), cache, chunk_size=11)  # a block longer than the window, in 3 chunks
        ref.prefill(committed)


def test_stopping_between_chunks_leaves_a_resumable_cache(gguf_and_model):
    _, model = gguf_and_model
    prompt = mx.array(_prompt(model, PROMPT))
    cache = model.make_cache()
    done = []
    for n in model.prefill_chunks(prompt, cache, chunk_size=20):
        done.append(n)
        if n >= 40:
            break  # the consumer stops between chunks
    assert done == [20, 40] and cache.offset == 40
    model.prefill(prompt[:, 40:], cache, chunk_size=20)
    whole = model.make_cache()
    model.prefill(prompt, whole, chunk_size=None)
    canvas = mx.array(_prompt(model, model.args.canvas_length, seed=3))
    assert rel_err(model.denoise(canvas, cache), model.denoise(canvas, whole)) <= TOL


def test_progress_counts_every_token(gguf_and_model):
    _, model = gguf_and_model
    cache = model.make_cache()
    assert list(model.prefill_chunks(mx.array(_prompt(model, 45)), cache, chunk_size=20)) == [20, 40, 45]
    with pytest.raises(ParameterError, match="chunk_size"):
        model.prefill(mx.array(_prompt(model, 5)), model.make_cache(), chunk_size=0)


def test_compiled_step_is_not_retraced_by_chunked_prefill(gguf_and_model):
    """The global layer is sized for the whole prompt up front, so chunks and committed
    blocks within a bucket keep the cache's shapes; the compiled step is traced once per
    length of the filled slots it reads (``cache.view_length``), never again at that length."""
    _, model = gguf_and_model
    traces = []
    real = model.denoise

    def counting(*a, **k):  # runs only while mx.compile traces
        traces.append(1)
        return real(*a, **k)

    model.denoise = counting
    try:
        cache = model.make_cache()
        model.prefill(mx.array(_prompt(model, 300)), cache, chunk_size=64)
        shapes = [a.shape for a in cache.state()]
        step = StepFunction(model, SamplerParams())
        C = model.args.canvas_length
        canvas = mx.array(_prompt(model, C, seed=4), dtype=mx.int32)
        hist = step.initial_history((1, C))
        views = set()
        for _ in range(3):
            for _ in range(2):  # a second step at the same length reuses the trace
                out = step(canvas, None, 0.5, mx.random.key(0), hist, cache)
                mx.eval(out["canvas"])
            views.add(tuple(a.shape for a in cache.step_state()))
            model.prefill(out["argmax"], cache, chunk_size=7)  # commit through the encoder
        assert [a.shape for a in cache.state()] == shapes
        assert len(traces) == len(views) <= 3
    finally:
        del model.denoise


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "none"])
def test_bounded_attention_is_exact(mask_kind):
    rng = np.random.default_rng(0)
    L, S = 37, 100
    q = mx.array(rng.normal(size=(1, 4, L, 8)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, 2, S, 8)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, 2, S, 8)).astype(np.float32))
    qp, kp = np.arange(S - L, S)[:, None], np.arange(S)[None, :]
    band = mx.array((kp <= qp) & (qp - kp < 20))
    mask = {"causal": "causal", "bool": band, "none": None}[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
    got = bounded_attention(q, k, v, mask, budget=4 * S * 4 * 5)  # 5 query rows per block
    assert rel_err(got, want) <= 1e-6
