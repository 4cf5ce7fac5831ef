"""The denoising loop against transformers' own ``_denoising_step``, driven by the same
scripted decoder logits: same temperatures, accepted masks, self-conditioning inputs, stop
step and committed block."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="compares with torch-based transformers")
gd = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma",
                         reason="transformers >= 5.23 with DiffusionGemma")

import inspect  # noqa: E402

from transformers.generation.logits_process import LogitsProcessorList  # noqa: E402

from mlx_dgemma.events import StepEvent  # noqa: E402
from mlx_dgemma.generation import BlockResult, denoise_block  # noqa: E402
from mlx_dgemma.sampler import SamplerParams  # noqa: E402
from mlx_dgemma.step import StepFunction  # noqa: E402
from tests.model_fakes import ScriptedDecoder  # noqa: E402

C, V = 24, 60


def scripted_logits(n_steps: int, seed: int) -> list[np.ndarray]:
    """Logits that sharpen step by step onto a fixed target, so the loop converges and stops."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, V, C)
    out = []
    for s in range(n_steps):
        x = rng.normal(0, 1, (1, C, V)).astype(np.float32)
        x[0, np.arange(C), target] += 2.0 + 3.0 * s
        out.append(x)
    return out


def reference_loop(logits, p: SamplerParams):
    fake_self = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=V)),
                                model=SimpleNamespace(decoder=SimpleNamespace(
                                    embed_tokens=SimpleNamespace(weight=torch.zeros(1)))))
    sampler = gd.EntropyBoundSampler(gd.EntropyBoundSamplerConfig(entropy_bound=p.entropy_bound), C, V,
                                     p.max_denoising_steps)
    proc = LogitsProcessorList([gd.LinearTemperatureScheduleLogitsProcessor(
        p.t_min, p.t_max, p.max_denoising_steps)])
    stop = gd.StableAndConfidentStoppingCriteria(p.stability_threshold, p.confidence_threshold)
    calls = iter(logits)
    seen_sc = []

    def decoder_forward(decoder_input_ids, self_conditioning_logits, **kw):
        seen_sc.append(None if self_conditioning_logits is None else self_conditioning_logits.numpy())
        return SimpleNamespace(logits=torch.from_numpy(next(calls)))

    # transformers 5.24 renamed the step's cache argument (``past_key_values`` -> ``cache``): pass
    # it under the name the installed version declares, so one test covers both
    step_params = inspect.signature(gd.DiffusionGemmaGenerationMixin._denoising_step).parameters
    cache_arg = {"cache" if "cache" in step_params else "past_key_values": None}
    canvas = torch.zeros(1, C, dtype=torch.long)
    argmax, sc = canvas, None
    finished = torch.zeros(1, dtype=torch.bool)
    masks, steps = [], 0
    for cur in reversed(range(1, p.max_denoising_steps + 1)):
        canvas, argmax, sc, finished = gd.DiffusionGemmaGenerationMixin._denoising_step(
            fake_self, decoder_forward=decoder_forward, current_canvas=canvas, argmax_canvas=argmax,
            input_ids=None, decoder_position_ids=None, self_conditioning_logits=sc, mask_mapping=None,
            **cache_arg, finished_denoising=finished, cur_step=cur, sampler=sampler,
            logits_processor=proc, diffusion_stopping_criteria=stop)
        masks.append(sampler.accepted_token_mask[0].numpy().copy())
        steps += 1
        if torch.all(finished):
            break
    return masks, steps, argmax[0].tolist(), seen_sc


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 1), (2, 2), (3, 0)])
def test_loop_matches_reference(seed, k):
    p = SamplerParams(max_denoising_steps=12, stability_threshold=k, confidence_threshold=0.05,
                      entropy_bound=0.3)
    logits = scripted_logits(12, seed)
    masks, steps, committed, seen_sc = reference_loop(logits, p)
    model = ScriptedDecoder(logits, C, V)
    # eager step: the fake decoder reads its inputs on the host, which a compiled trace forbids
    events = list(denoise_block(StepFunction(model, p, compile=False), model.make_cache(), p, mx.random.key(seed)))
    result = events[-1]
    steps_ev = [e for e in events if isinstance(e, StepEvent)]
    assert isinstance(result, BlockResult)
    assert result.steps == steps == len(steps_ev)
    assert steps < 12  # the stopping rule fired before the step budget
    assert steps_ev[-1].stopped and not any(e.stopped for e in steps_ev[:-1])
    assert result.tokens == committed
    for e, m in zip(steps_ev, masks):
        assert np.array_equal(e.accepted, m)
    assert [e.temperature for e in steps_ev] == pytest.approx(
        [p.t_min + (p.t_max - p.t_min) * left / 12 for left in range(12, 12 - steps, -1)])
    # self-conditioning: none on step 1, then the previous step's temperature-scaled logits
    assert model.sc_inputs[0] is None and seen_sc[0] is None
    for ours, theirs in zip(model.sc_inputs[1:], seen_sc[1:]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)
