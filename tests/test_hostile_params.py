"""Hostile generation parameters: every bad flag is a one-line error naming the flag, checked
before any work; non-finite logits are an error naming the step, never a blank answer."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_dgemma import load, stream_generate
from mlx_dgemma.cli import main
from mlx_dgemma.errors import NonFiniteError, ParameterError
from mlx_dgemma.sampler import SamplerParams


def run_generate(capsys, *args) -> tuple[int, str]:
    code = main(["generate", *map(str, args)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("loading", "\r", "["))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.mark.parametrize("flag, value", [
    ("--stability-threshold", "1000000000"),
    ("--seed", "-1"),
    ("--seed", str(2**70)),
    ("--t-max", "inf"),
    ("--t-max", "nan"),
    ("--t-min", "1e-310"),  # denormal: logits / T overflow to inf
    ("--t-min=-0.5", None),
    ("--entropy-bound", "nan"),
    ("--confidence-threshold=-inf", None),
    ("--steps", "0"),
    ("--max-tokens", "-3"),
    ("--sc-top-k", "0"),
])
def test_bad_flag_is_named_before_loading(tmp_path, capsys, flag, value):
    # --model points nowhere: the flag must be rejected before the model is even looked at
    args = (flag,) if value is None else (flag, value)
    code, line = run_generate(capsys, "--model", tmp_path / "nope", "--prompt", "hi", *args)
    assert code == 2 and line.startswith(f"mlx-dgemma generate: error: {flag.split('=')[0]} ") and "must be" in line


def test_sc_top_k_above_the_vocabulary(tiny_model_dir, capsys):
    code, line = run_generate(capsys, "--model", tiny_model_dir, "--prompt", "hi", "--sc-top-k", "100000")
    assert code == 2 and "--sc-top-k 100000" in line and "[1, 512]" in line


def test_non_utf8_prompt(tmp_path, capsys):
    prompt = b"caf\xe9 latte".decode("utf-8", "surrogateescape")  # how argv delivers such bytes
    code, line = run_generate(capsys, "--model", tmp_path / "nope", "--prompt", prompt)
    assert code == 2 and "--prompt" in line and "UTF-8" in line and "\\xe9" in line


def test_trace_into_a_missing_directory_fails_before_generating(tmp_path, tiny_model_dir, capsys):
    code, line = run_generate(capsys, "--model", tiny_model_dir, "--prompt", "hi",
                              "--trace", tmp_path / "no" / "t.jsonl")
    assert code == 2 and "--trace" in line and "does not exist" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_trace_onto_an_existing_directory(tmp_path, tiny_model_dir, capsys):
    code, line = run_generate(capsys, "--model", tiny_model_dir, "--prompt", "hi", "--trace", tmp_path)
    assert code == 2 and "is a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_huge_stability_threshold_in_generation_config(tmp_path, tiny_model_dir, capsys):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg["stability_threshold"] = 1_000_000_000
    (d / "generation_config.json").write_text(json.dumps(cfg))
    code, line = run_generate(capsys, "--model", d, "--prompt", "hi", "--steps", "2")
    assert code == 2 and "stability_threshold" in line and "generation_config.json" in line


def test_sampler_params_reject_wrong_types():
    for bad in ({"t_min": "warm"}, {"max_denoising_steps": 4.5}, {"seed": True}, {"eos_token_id": ["x"]},
                {"stability_threshold": [1]}):
        with pytest.raises(ParameterError):
            SamplerParams.from_config(bad)


def test_non_finite_logits_name_the_step(tiny_model_dir):
    from mlx.utils import tree_flatten, tree_unflatten

    rt = load(tiny_model_dir)
    model, tok = rt.model, rt.tokenizer
    flat = dict(tree_flatten(model.parameters()))
    # poison the top-level norms: the logits become NaN (before: exit 0 and a blank answer)
    norms = [k for k in flat if k.endswith("norm.weight") and "layers" not in k]
    assert norms
    for k in norms:
        flat[k] = mx.full(flat[k].shape, float("nan"))
    model.update(tree_unflatten(list(flat.items())))
    with pytest.raises(NonFiniteError, match=r"block 1, step \d+: .*NaN or Inf"):
        list(stream_generate(rt, "hi", seed=0, max_denoising_steps=3, max_new_tokens=8))
