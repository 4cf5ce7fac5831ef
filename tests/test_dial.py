"""The speed/quality dial: the confidence-threshold acceptance mode (``accept_probability``) on
handmade logits whose probabilities are known by construction, the loop that stops once every
position is revealed, and the step cap (``max_denoising_steps``) scaling the schedule."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import load, stream_generate
from mlx_dgemma.cli import main
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.events import StepEvent
from mlx_dgemma.generation import BlockResult, denoise_block
from mlx_dgemma.sampler import SamplerParams, confidence_reveal, sample_step
from mlx_dgemma.step import StepFunction
from tests.model_fakes import ScriptedDecoder


def logits_of(probs: list[list[float]]) -> mx.array:
    """[1, C, V] logits whose softmax is ``probs`` (each row sums to 1)."""
    return mx.array([[[math.log(p) for p in row] for row in probs]], dtype=mx.float32)


def test_reveals_confident_hidden_positions_and_keeps_revealed_ones():
    x = logits_of([[0.95, 0.04, 0.01],   # p = 0.95 >= 0.9: revealed as token 0
                   [0.5, 0.3, 0.2],      # p = 0.5: stays hidden
                   [0.005, 0.99, 0.005],  # confident, but already revealed as 2: keeps 2
                   [0.02, 0.02, 0.96]])  # revealed as token 2
    argmax = mx.argmax(x, axis=-1).astype(mx.int32)
    out = confidence_reveal(x, argmax, mx.array([[-1, -1, 2, -1]], dtype=mx.int32), 0.9)
    assert out.tolist() == [[0, -1, 2, 2]]


def test_reveals_the_most_confident_when_none_reaches_the_threshold():
    x = logits_of([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [0.4, 0.3, 0.3], [0.1, 0.1, 0.8]])
    argmax = mx.argmax(x, axis=-1).astype(mx.int32)
    # position 3 (0.8) is revealed already; of the hidden ones position 1 (0.6) is the most confident
    out = confidence_reveal(x, argmax, mx.array([[-1, -1, -1, 2]], dtype=mx.int32), 0.9)
    assert out.tolist() == [[-1, 1, -1, 2]]
    # everything revealed: nothing changes, nothing is forced
    done = mx.array([[1, 0, 2, 0]], dtype=mx.int32)
    assert confidence_reveal(x, argmax, done, 0.9).tolist() == [[1, 0, 2, 0]]


def test_threshold_is_on_the_temperature_scaled_probability():
    # p = (0.8, 0.2): below 0.9 as given; at temperature 0.5 it is 0.64 / 0.68 = 0.941
    x = logits_of([[0.8, 0.2], [0.5, 0.5]])
    out = sample_step(x, 0.5, 0.1, 2, mx.random.key(0), accept_probability=0.9)
    assert out["revealed"].tolist() == [[0, -1]]
    assert out["accepted"].tolist() == [[True, False]]
    assert out["canvas"].tolist()[0][0] == 0  # a revealed position carries its token, not noise
    at_one = sample_step(x, 1.0, 0.1, 2, mx.random.key(0), accept_probability=0.9)
    assert at_one["revealed"].tolist() == [[0, -1]]  # forced: the most confident hidden position


C, V = 6, 5


def test_loop_reveals_step_by_step_and_stops_when_all_are_revealed():
    # step s: positions 2s and 2s + 1 get p = 0.97 on token (s + pos) % V, the rest uniform
    steps = []
    for s in range(3):
        p = np.full((C, V), 1 / V)
        for pos in (2 * s, 2 * s + 1):
            p[pos] = 0.03 / (V - 1)
            p[pos, (s + pos) % V] = 0.97
        steps.append(np.log(p)[None].astype(np.float32))
    steps += [steps[-1]] * 5  # would be read if the loop did not stop
    params = SamplerParams(max_denoising_steps=8, t_min=0.999, t_max=1.0, accept_probability=0.9,
                           stability_threshold=1, confidence_threshold=1e-12)  # the entropy stop never fires
    model = ScriptedDecoder(steps, C, V)  # eager step only: the scripted logits are read on the host
    events = list(denoise_block(StepFunction(model, params, compile=False), model.make_cache(), params,
                                mx.random.key(3)))
    evs = [e for e in events if isinstance(e, StepEvent)]
    assert len(evs) == 3 and evs[-1].stopped and not any(e.stopped for e in evs[:-1])
    assert [e.accepted.tolist() for e in evs] == [[True, True, False, False, False, False],
                                                 [True, True, True, True, False, False],
                                                 [True] * 6]
    # revealed positions are fed back with their token; hidden ones are noise
    assert [int(t) for t in evs[1].canvas[:4]] == [0, 1, 3, 4]
    result = events[-1]
    assert isinstance(result, BlockResult) and result.steps == 3
    assert result.tokens == [int(t) for t in np.argmax(steps[2][0], axis=-1)]  # the last step's argmax


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_accept_probability_out_of_range(bad):
    with pytest.raises(ParameterError, match="accept_probability"):
        SamplerParams(accept_probability=bad).validate()


def test_accept_probability_flag_is_named(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--accept-probability", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--accept-probability 2" in err and "[0, 1]" in err and "Traceback" not in err


@pytest.mark.parametrize("cap", [3, 5])
def test_step_cap_scales_the_schedule(tiny_model_dir, cap):
    rt = load(tiny_model_dir)
    evs = [e for e in stream_generate(rt, "hi", seed=0, max_denoising_steps=cap, t_min=0.2, t_max=0.6,
                                      confidence_threshold=1e-12, max_new_tokens=1)
           if isinstance(e, StepEvent)]
    assert len(evs) == cap and all(e.max_steps == cap for e in evs)
    # step i of N runs at t_min + (t_max - t_min) * (N - i + 1) / N: t_max first, t_min + delta / N last
    assert [e.temperature for e in evs] == pytest.approx([0.2 + 0.4 * (cap - i) / cap for i in range(cap)])


def test_fast_self_conditions_from_the_top_64(tiny_model_dir):
    from mlx_dgemma.precision import FAST_SC_TOP_K

    fast = load(tiny_model_dir, precision="fast")
    exact = load(tiny_model_dir, precision="exact")
    V = fast.model.args.vocab_size
    assert FAST_SC_TOP_K == 64 < V
    assert fast.step(SamplerParams()).sc_top_k == 64  # the runtime's step: the precision's k
    assert exact.step(SamplerParams()).sc_top_k is None
    assert fast.step(SamplerParams(sc_top_k=16)).sc_top_k == 16  # a request's own k wins
    assert fast.step(SamplerParams(sc_top_k=V)).sc_top_k is None  # all = exact
