"""The typed request (mlx_dgemma.request): checked once when built, in the registry's words, the
same object from a front end to generation (across mlx.launch's ranks as JSON)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from mlx_dgemma import params
from mlx_dgemma.canvas import CanvasTemplate
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.request import TOKEN_IDS, GenerationRequest
from mlx_dgemma.schema import SamplerDefaults


def test_every_field_is_checked_when_built_in_the_registrys_words():
    for p in params.PARAMS:
        bad = p.high * 10 + 1 if p.high > 0 else -1
        with pytest.raises(ParameterError) as e:
            GenerationRequest.of({p.name: bad})
        assert e.value.param == p.name and e.value.rule == p.rule
        assert e.value.restated(p.name) == f"{p.name}: must be {p.rule}"
    with pytest.raises(ParameterError, match=r"unknown generation parameter\(s\) \['temperature'\]"):
        GenerationRequest.of({"temperature": 0.5})
    with pytest.raises(ParameterError, match="logprobs"):
        GenerationRequest.of(logprobs=-1)
    with pytest.raises(ParameterError, match="seed = True"):
        GenerationRequest.of({"seed": True})  # a bool is not an integer


def test_a_request_is_a_read_only_view_of_what_was_given():
    r = GenerationRequest.of({"seed": 3, "t_min": 0.2, "max_new_tokens": None}, logprobs=2)
    assert r.params == {"t_min": 0.2, "seed": 3} and "seed" in r and r["seed"] == 3 and "max_new_tokens" not in r
    assert [k for k, _ in r.sampler] == ["t_min", "seed"]  # the registry's order, whatever the caller's
    assert r.with_params(seed=None).params == {"t_min": 0.2} and r.params["seed"] == 3  # a new request
    with pytest.raises(ParameterError):
        r.with_params(t_min=0.0)  # a change is checked as the original was
    with pytest.raises(Exception):
        r.logprobs = 5  # type: ignore[misc]  # frozen


def test_json_round_trip_is_the_same_request():
    """What mlx.launch's broadcast carries to the other ranks reads back as the same request."""
    import json

    r = GenerationRequest.of({"seed": 2**63, "accept_probability": 0.9, "eos_token_id": [1, 2]}, logprobs=0,
                             template=[(0, 5), (3, 7)])
    assert isinstance(r.template, CanvasTemplate) and r["eos_token_id"] == (1, 2)
    assert GenerationRequest.from_json(json.loads(json.dumps(r.to_json()))) == r


def test_the_token_ids_a_request_may_set_are_the_samplers():
    assert set(TOKEN_IDS) == {f.name for f in fields(SamplerDefaults)} - {p.name for p in params.PARAMS}


def test_the_rule_between_fields_names_the_field_given_and_quotes_the_models_defaults():
    demo = {"t_min": 0.05, "t_max": 0.25}
    with pytest.raises(ParameterError) as e:
        GenerationRequest.of({"t_min": 0.9}).resolve(demo)
    assert e.value.param == "t_min" and e.value.rule == "below the first-step temperature (0.25)"
    assert e.value.restated("--t-min 0.9") == ("--t-min 0.9: must be below the first-step temperature (0.25); the "
                                               "temperature falls from the first step to the last (this model's "
                                               "defaults are 0.05 and 0.25)")
    with pytest.raises(ParameterError) as e:
        GenerationRequest.of({"t_min": 0.9, "t_max": 0.5}).resolve(demo)
    assert e.value.param == "t_max" and e.value.rule == "above the temperature floor (0.9)"
    assert GenerationRequest.of({"t_max": 0.9}).resolve(demo).t_max == 0.9


def test_stream_generate_takes_a_request_or_its_keyword_form_not_both(tiny_model_dir):
    from mlx_dgemma import load, stream_generate

    rt = load(tiny_model_dir)
    kw = {"max_new_tokens": 8, "max_denoising_steps": 1, "seed": 0}
    by_request = list(stream_generate(rt, "hi", request=GenerationRequest.of(kw)))
    by_keywords = list(stream_generate(rt, "hi", **kw))
    assert by_request[-1].tokens == by_keywords[-1].tokens
    with pytest.raises(ParameterError, match="not both"):
        list(stream_generate(rt, "hi", request=GenerationRequest.of(kw), seed=1))


def test_the_request_imports_no_mlx():
    """The command line builds its request before anything heavy is imported."""
    code = ("import sys, mlx_dgemma.request; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'numpy')], 'MLX or numpy imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
