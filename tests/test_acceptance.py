"""The acceptance modes (mlx_dgemma.acceptance): each a class chosen once from the sampler's
parameters; a new mode is its parameter in the registry and its class, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_dgemma.acceptance import MODES, ConfidenceThreshold, EntropyBound, acceptance_of  # noqa: E402
from mlx_dgemma.errors import ParameterError  # noqa: E402
from mlx_dgemma.sampler import SamplerParams  # noqa: E402
from mlx_dgemma.step import step_key  # noqa: E402


def test_the_mode_is_chosen_from_the_parameters():
    assert type(acceptance_of(SamplerParams())) is EntropyBound
    assert type(acceptance_of(SamplerParams(accept_probability=0.9))) is ConfidenceThreshold
    assert type(acceptance_of(SamplerParams(), ranks=2)) is EntropyBound  # the reference runs across ranks


def test_a_mode_that_runs_in_one_process_is_refused_across_ranks():
    with pytest.raises(ParameterError) as e:
        acceptance_of(SamplerParams(accept_probability=0.9), ranks=2)
    assert str(e.value) == ("accept_probability: the confidence-threshold mode runs in one process; leave it out "
                            "under mlx.launch (EntropyBound, the default, runs across ranks)")


def test_every_modes_baked_in_fields_key_the_trace():
    base = SamplerParams(accept_probability=0.9)
    for mode in MODES:
        for name in mode.traced:
            other = SamplerParams(**{**{"accept_probability": 0.9}, name: getattr(base, name) / 2})
            assert step_key(other, mx.float32) != step_key(base, mx.float32), (mode.__name__, name)


# A third mode declared in the two places a mode lives (its registry parameter, its class) and
# nowhere else: a fresh interpreter adds both before anything reads them, then generates with it.
NEW_PARAM = ("params.Param('accept_top_k', int, 1, 4096, 'an integer in [1, 4096] (leave it out for EntropyBound)', "
             "'--accept-top-k', 'K', 'reveal the K most confident hidden positions per step', "
             "label='accept top-k', screen_order=7, no_default='off: EntropyBound', server=True, model_default=False)")

NEW_MODE = """
class TopK(acceptance.Acceptance):
    param = "accept_top_k"
    traced = ("accept_top_k",)
    label = "top-k"

    def select(self, processed, argmax, entropy, draw, noise, revealed, fixed):
        top = mx.max(processed, axis=-1) - mx.logsumexp(processed, axis=-1)
        hidden = revealed < 0
        rank = mx.argsort(mx.argsort(-mx.where(hidden, top, -mx.inf), axis=-1), axis=-1)
        revealed = mx.where(hidden & (rank < self.params.accept_top_k), argmax, revealed)
        accepted = revealed >= 0
        return accepted, mx.where(accepted, revealed, noise), revealed

    def stop(self, stop, accepted):
        return stop | mx.all(accepted, axis=-1)
"""

GENERATE = """
import json
import mlx.core as mx
from mlx_dgemma import params
params.PARAMS = params.PARAMS + ({param},)
from mlx_dgemma import acceptance, load, stream_generate
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.events import DoneEvent, StepEvent
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import step_key
{mode}
rt = load({model!r})
C = rt.model.args.canvas_length
events = list(stream_generate(rt, "hi", accept_top_k=3, max_new_tokens=C, max_denoising_steps=64, seed=0,
                              stability_threshold=10_000, commit_entropy=0))
steps = [e for e in events if isinstance(e, StepEvent)]
refused = []
for bad in ({{"accept_top_k": 0}}, {{"accept_top_k": 2, "accept_probability": 0.9}}):
    try:
        list(stream_generate(rt, "hi", **bad))
    except ParameterError as e:
        refused.append(str(e))
try:
    acceptance.acceptance_of(SamplerParams(accept_top_k=2), ranks=2)
except ParameterError as e:
    refused.append(str(e))
print(json.dumps({{"C": C, "accepted": [int(e.accepted.sum()) for e in steps], "stopped": steps[-1].stopped,
                  "done": type(events[-1]).__name__, "refused": refused,
                  "keyed": step_key(SamplerParams(accept_top_k=2), mx.float32) !=
                           step_key(SamplerParams(accept_top_k=3), mx.float32)}}))
"""


def test_a_new_mode_is_its_parameter_and_its_class(tiny_model_dir):
    """The new mode reaches the compiled step from its two declarations: it reveals K positions per
    step and ends the block once all are revealed, its parameter keys the trace, a second mode
    given with it is refused, and so is running it across ranks."""
    script = textwrap.dedent(GENERATE.format(param=NEW_PARAM, mode=NEW_MODE, model=str(tiny_model_dir)))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    C = out["C"]
    n = -(-C // 3)
    assert out["accepted"] == [min(3 * i, C) for i in range(1, n + 1)]
    assert out["stopped"] and out["done"] == "DoneEvent"
    assert out["keyed"]
    assert out["refused"] == [
        "accept_top_k = 0: must be an integer in [1, 4096] (leave it out for EntropyBound)",
        "accept_probability and accept_top_k: each selects an acceptance mode; give one of them",
        "accept_top_k: the top-k mode runs in one process; leave it out under mlx.launch (EntropyBound, the "
        "default, runs across ranks)"]
