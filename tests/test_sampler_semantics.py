"""The sampler against transformers' own classes on controlled inputs: same logits and the
same random draws give the same temperatures, accepted masks, renoised canvases, stop
decisions (including the stability history's start state) and EOS padding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="semantics tests compare with torch-based transformers")
gd = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma",
                         reason="transformers >= 5.23 with DiffusionGemma")

from mlx_dgemma.sampler import (SamplerParams, accept_mask, finalize_block, sample_step,  # noqa: E402
                                stop_update, temperature, token_entropy)


def logits_with_spread(rng, B=1, C=64, V=300):
    """Logits whose positions range from near-certain to near-uniform."""
    sharp = rng.uniform(0, 12, (B, C, 1))
    return (rng.normal(0, 1, (B, C, V)) * sharp).astype(np.float32)


@pytest.mark.parametrize("N", [48, 16, 5])
def test_temperature_schedule(N):
    p = SamplerParams(max_denoising_steps=N, t_min=0.4, t_max=0.8)
    proc = gd.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=N)
    scores = torch.ones(1, 2, 3)
    ours = [temperature(left, p) for left in range(N, 0, -1)]
    theirs = [float(1.0 / proc(None, scores, torch.tensor(left))[0, 0, 0]) for left in range(N, 0, -1)]
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert ours[0] == pytest.approx(0.8)  # first step at t_max
    assert ours[-1] == pytest.approx(0.4 + 0.4 / N)  # the reference never reaches t_min exactly


def test_entropy_matches_categorical():
    rng = np.random.default_rng(0)
    x = logits_with_spread(rng)
    ours = np.array(token_entropy(mx.array(x)))
    theirs = torch.distributions.Categorical(logits=torch.from_numpy(x)).entropy().numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bound", [0.1, 0.5, 2.0])
def test_accept_and_renoise_match_reference(seed, bound):
    rng = np.random.default_rng(seed)
    x = logits_with_spread(rng)
    B, C, V = x.shape
    current = rng.integers(0, V, (B, C))
    draw = rng.integers(0, V, (B, C))
    noise = rng.integers(0, V, (B, C))
    s = gd.EntropyBoundSampler(gd.EntropyBoundSamplerConfig(entropy_bound=bound), C, V, 48)
    accepted_ref = s.accept_canvas(torch.from_numpy(current), torch.from_numpy(draw), torch.from_numpy(x), 1)
    s.initialize_canvas = lambda batch_size, device: torch.from_numpy(noise)  # same "random" tokens
    renoised_ref = s.renoise_canvas(accepted_ref, 1).numpy()
    mask_ref = s.accepted_token_mask.numpy()

    mask = np.array(accept_mask(token_entropy(mx.array(x)), bound))
    assert np.array_equal(mask, mask_ref)
    assert 0 < mask.sum() < C  # a real mix of accepted and renoised positions
    assert np.array_equal(np.where(mask, draw, noise), renoised_ref)


def test_sample_step_uses_its_draws_where_accepted():
    rng = np.random.default_rng(3)
    x = mx.array(logits_with_spread(rng))
    out = sample_step(x, 0.5, 0.3, 300, mx.random.key(7))
    processed = np.array(out["processed"])
    np.testing.assert_allclose(processed, np.array(x) / 0.5, rtol=1e-6)
    acc = np.array(out["accepted"])
    assert np.array_equal(acc, np.array(accept_mask(token_entropy(x / 0.5), 0.3)))
    # near-certain accepted positions draw their argmax
    ent = np.array(out["entropy"])
    sure = acc & (ent < 1e-4)
    assert sure.any()
    assert np.array_equal(np.array(out["canvas"])[sure], np.array(out["argmax"])[sure])
    again = sample_step(x, 0.5, 0.3, 300, mx.random.key(7))
    assert np.array_equal(np.array(again["canvas"]), np.array(out["canvas"]))  # reproducible


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_stop_decisions_match_reference(k):
    rng = np.random.default_rng(k)
    C, V = 16, 50
    base = rng.integers(0, V, (1, C))
    other = rng.integers(0, V, (1, C))
    confident = np.full((1, C, V), -20.0, np.float32)
    confident[0, np.arange(C), base[0]] = 20.0
    unsure = rng.normal(0, 0.1, (1, C, V)).astype(np.float32)
    # argmax sequence: change, repeat, repeat, repeat, change, repeat...
    seq = [(other, confident), (base, unsure), (base, confident), (base, confident), (base, confident),
           (other, confident), (other, confident), (base, confident), (base, confident), (base, confident)]
    ref = gd.StableAndConfidentStoppingCriteria(stability_threshold=k, confidence_threshold=0.005)
    history = None  # what the compiled step carries from one step to the next
    got, want = [], []
    for argmax, lg in seq:
        want.append(bool(ref(torch.from_numpy(argmax), torch.from_numpy(lg))[0]))
        stop, history = stop_update(history, mx.array(argmax, dtype=mx.int32), token_entropy(mx.array(lg)), k, 0.005)
        got.append(bool(stop[0]))
    assert got == want
    assert any(want) and not all(want)
    if k >= 1:  # the history starts at -1: k + 1 identical canvases in a row are needed
        first = want.index(True)
        assert first >= k


@pytest.mark.parametrize("seed", range(4))
def test_eos_padding_matches_reference(seed):
    rng = np.random.default_rng(seed)
    C = 32
    block = rng.integers(2, 200, C).tolist()
    if seed:
        for pos in rng.choice(C, seed, replace=False):
            block[pos] = int(rng.choice([1, 106, 50]))
    ours, finished = finalize_block(list(block), (1, 106, 50), 0)

    from transformers.generation.stopping_criteria import EosTokenCriteria, StoppingCriteriaList

    cfg = gd.DiffusionGemmaGenerationConfig(pad_token_id=0, eos_token_id=[1, 106, 50])
    ids = torch.tensor([[5, 6, *block]])
    crit = StoppingCriteriaList([EosTokenCriteria(eos_token_id=[1, 106, 50])])
    ref_ids, ref_finished = gd.DiffusionGemmaGenerationMixin._finalize_canvas(
        ids, torch.zeros(1, dtype=torch.bool), cfg, crit, C, torch.tensor([1, 106, 50]))
    assert ours == ref_ids[0, 2:].tolist()
    assert finished == bool(ref_finished[0])


def test_schedule_error_quotes_the_models_defaults_not_the_references():
    """A crossed schedule names the values the caller overrode (the demo's 0.05/0.25 here), never
    the reference's 0.4/0.8 whatever the model."""
    from mlx_dgemma.errors import ParameterError

    model = SamplerParams(t_min=0.05, t_max=0.25)
    with pytest.raises(ParameterError) as e:
        model.with_overrides(t_min=0.9)
    # the error names the parameter the caller gave (t_min), its rule the other's value
    assert "this model's defaults are 0.05 and 0.25" in str(e.value) and e.value.param == "t_min"
    assert "0.4" not in str(e.value) and "0.8" not in str(e.value)
