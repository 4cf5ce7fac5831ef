"""``bench --e2e`` on a tiny random model: both loops run (ours and mlx-vlm's own), the rows hold
what the table promises, and the definitions (answer tokens up to the end of the turn, tokens/s
as a ratio of sums) hold. No timing is asserted."""

from __future__ import annotations

import argparse

import pytest

from mlx_dgemma.bench.e2e import _answer_tokens, _summary, e2e_ours, e2e_table, main

OVERRIDES = {"max_denoising_steps": 3, "max_new_tokens": 32}  # one block of the tiny model's canvas


def test_answer_tokens_stop_before_the_first_eos():
    assert _answer_tokens([5, 7, 106, 9, 1], (1, 106, 50)) == [5, 7]
    assert _answer_tokens([5, 7], (1,)) == [5, 7]
    assert _answer_tokens([1, 5], (1,)) == []


def test_summary_is_a_ratio_of_sums():
    runs = [{"answer_ids": [1] * 6, "wall_s": 2.0, "prefill_s": 0.5, "first_block_s": 1.0, "prompt_tokens": 10,
             "steps_per_block": [3]},
            {"answer_ids": [1] * 2, "wall_s": 6.0, "prefill_s": 1.5, "first_block_s": 3.0, "prompt_tokens": 20,
             "steps_per_block": [4, 5]}]
    r = _summary("x", "y", runs)
    assert r["answer_tokens_per_s"] == pytest.approx(8 / 8.0)
    assert r["mean_steps_per_block"] == pytest.approx(12 / 3)
    assert r["s_per_step"] == pytest.approx((8.0 - 2.0) / 12)
    assert r["tokens_per_forward"] == pytest.approx(8 / 12)
    assert r["prefill_tokens_per_s"] == pytest.approx(30 / 2.0)
    assert r["median_first_block_s"] == pytest.approx(2.0)


def test_both_loops_on_a_tiny_model(tiny_gguf):
    pytest.importorskip("mlx_vlm", reason="the peer: pip install -e '.[bench]'")
    from mlx_dgemma.bench.e2e import e2e_mlx_vlm

    model = str(tiny_gguf)
    ours = e2e_ours(model, ["hi there"], [0], overrides=OVERRIDES, warmup=False)
    conf = e2e_ours(model, ["hi there"], [0], overrides={**OVERRIDES, "accept_probability": 0.9}, warmup=False)
    vlm = e2e_mlx_vlm(model, ["hi there"], [0], overrides=OVERRIDES, warmup=False)
    vlm_eb = e2e_mlx_vlm(model, ["hi there"], [0], sampler="entropy-bound", overrides=OVERRIDES, warmup=False)
    dense = e2e_mlx_vlm(model, ["hi there"], [0], overrides=OVERRIDES, warmup=False, bits=None)
    for row in (ours, conf, vlm, vlm_eb, dense):
        assert row["blocks"] == 1 and 1 <= row["steps"] <= 3
        (run,) = row["runs"]
        assert run["prompt_tokens"] == ours["runs"][0]["prompt_tokens"]  # the same prompt ids
        assert len(run["answer_ids"]) <= 32 and not set(run["answer_ids"]) & {1, 106, 50}
        assert 0 < run["first_block_s"] <= run["wall_s"]
    # each row in its acceptance mode's words (mlx_dgemma.acceptance: the label and the value of
    # the parameter that selects it); accept_probability 0.9 alone is the dial's `fast` setting,
    # and the row says so
    from mlx_dgemma.acceptance import ConfidenceThreshold, EntropyBound

    cth = f"{ConfidenceThreshold.label} 0.9"
    assert ours["sampler"] == EntropyBound.label and conf["sampler"] == f"{cth} (--quality fast)"
    assert vlm["sampler"] == cth and vlm_eb["sampler"] == EntropyBound.label
    # the fair rows are quantized like ours (mlx-vlm's own 8-bit); the dense one says it is a reference
    assert vlm["impl"] == vlm_eb["impl"] == "mlx-vlm (8-bit g64, its own quant.)"
    assert dense["impl"] == "mlx-vlm (dense f32, reference)"
    table = e2e_table({"machine": {"platform": "p", "device": "cpu", "mlx": "0"}, "prompts": ["hi there"],
                       "models": {model: {"ours-default": ours, "mlx-vlm-default": vlm,
                                          "mlx-vlm-dense-default": dense, "ours_vs_mlx_vlm_defaults": 1.5,
                                          "ours_vs_mlx_vlm_dense_defaults": 0.5}}})
    assert "8-bit g64" in table and "dense f32, reference" in table and "mlx-dgemma" in table
    assert "(both quantized), each with its default sampler: 1.50x" in table
    assert "dense float32 (reference), each with its default sampler: 0.50x" in table


def test_the_fair_ratios_compare_quantized_rows(monkeypatch):
    from mlx_dgemma.bench.e2e import ROWS, run_e2e

    rows = {name: kw for name, _, kw in ROWS}
    assert rows["mlx-vlm-default"].get("bits", "default") == "default"  # e2e_mlx_vlm's default: 8-bit
    assert rows["mlx-vlm-dense-default"]["bits"] is None
    fake = {"ours-default": 2.0, "mlx-vlm-default": 4.0, "mlx-vlm-entropy-bound": 1.0, "ours-confidence": 3.0,
            "ours-balanced": 5.0, "mlx-vlm-dense-default": 8.0}

    import mlx_dgemma.bench.e2e as e2e

    def measured(target, timeout=None, model=None, prompts=(), seeds=(), **kw):
        name = next(n for n, t, k in ROWS if t == target and k.get("sampler") == kw.get("sampler")
                    and k.get("bits", "d") == kw.get("bits", "d")
                    and k.get("overrides", {}) == kw["overrides"])
        return {"impl": name, "answer_tokens_per_s": fake[name]}

    monkeypatch.setattr(e2e, "isolated", measured)
    entry = run_e2e(["m.gguf"], ["p"], [0])["models"]["m.gguf"]
    assert entry["ours_vs_mlx_vlm_defaults"] == 0.5 and entry["ours_vs_mlx_vlm_entropy_bound"] == 2.0
    assert entry["ours_vs_mlx_vlm_confidence"] == 0.75 and entry["ours_vs_mlx_vlm_dense_defaults"] == 0.25
    assert entry["ours_balanced_vs_mlx_vlm_default"] == 1.25  # the dial's balanced row against the peer's default
    assert rows["ours-balanced"]["overrides"] == {"stability_threshold": 0, "confidence_threshold": 0.05}


def test_missing_model_is_one_line(tmp_path):
    from mlx_dgemma.errors import ParameterError

    args = argparse.Namespace(e2e_models=str(tmp_path / "nope.gguf"), e2e_prompts=1, child_timeout=10,
                              json=str(tmp_path / "e.json"))
    with pytest.raises(ParameterError, match="--e2e-models: .*nope.gguf: no such file"):
        main(args)


def test_interleaved_rows_give_the_same_answers(tiny_gguf):
    """``--e2e-interleave`` (rows taking turns prompt by prompt, each in a long-lived process)
    measures the same answers as the rows run one after the other."""
    pytest.importorskip("mlx_vlm", reason="the peer: pip install -e '.[bench]'")
    from mlx_dgemma.bench.e2e import ROWS, e2e_mlx_vlm, run_e2e

    model, prompts, seeds = str(tiny_gguf), ["hi there", "who made the stars?"], [0, 1]
    rows = tuple(r for r in ROWS if r[0] in ("ours-default", "mlx-vlm-default"))
    res = run_e2e([model], prompts, seeds, rows=rows, overrides=OVERRIDES, interleave=True)
    entry = res["models"][model]
    assert res["interleaved"] and "ours_vs_mlx_vlm_defaults" in entry
    alone = {"ours-default": e2e_ours(model, prompts, seeds, overrides=OVERRIDES, warmup=False),
             "mlx-vlm-default": e2e_mlx_vlm(model, prompts, seeds, overrides=OVERRIDES, warmup=False)}
    for name, row in alone.items():
        assert entry[name]["impl"] == row["impl"] and entry[name]["sampler"] == row["sampler"]
        assert [r["answer_ids"] for r in entry[name]["runs"]] == [r["answer_ids"] for r in row["runs"]]
        assert [r["prompt"] for r in entry[name]["runs"]] == prompts


def test_the_table_keeps_its_columns_under_a_long_sampler_label():
    # "confidence-threshold 0.9 (--quality fast)" pushed its row's numbers out of line
    from mlx_dgemma.bench.e2e import e2e_table

    def row(impl: str, sampler: str) -> dict:
        return {"impl": impl, "sampler": sampler, "answer_tokens_per_s": 1.0, "mean_steps_per_block": 2.0,
                "s_per_step": 0.5, "tokens_per_forward": 3.0, "median_first_block_s": 1.0,
                "prefill_tokens_per_s": 10.0, "answer_tokens": 7}

    table = e2e_table({"machine": {"platform": "p", "device": "cpu", "mlx": "0"}, "prompts": ["x"],
                       "models": {"m.gguf": {"a": row("ours", "EntropyBound"),
                                             "b": row("ours", "confidence-threshold 0.9 (--quality fast)"),
                                             "c": row("a much longer implementation name than forty-two", "x")}}})
    lines = [ln for ln in table.splitlines() if ln.rstrip().endswith(" 7")]
    assert len(lines) == 3
    assert len({ln.index(" 1.00 ") for ln in lines}) == 1 and len({len(ln) for ln in lines}) == 1, table
