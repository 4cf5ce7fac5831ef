"""End to end: a tiny DiffusionGemma GGUF in the published naming converts, verifies, loads."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma.cli import main
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.verify import open_model_dir, verify


def test_converted_directory_layout(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer_gguf.json", "chat_template.jinja",
            "model.safetensors.index.json", "conversion_report.json"} <= names
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["canvas_length"] == 32
    tc = cfg["text_config"]
    assert tc["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert tc["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    q = cfg["quantization"]
    emb = q["embed_tokens"]
    assert emb == {"bits": 6, "group_size": 32, "scale_dtype": "float32", "subblock": 16, "ggml_type": "Q6_K"}
    assert q["layers.0.self_attn.q_proj"]["ggml_type"] == "Q4_K"
    assert q["layers.0.experts.down_proj"]["ggml_type"] in ("Q5_0", "Q8_0")
    assert q["layers.0.experts.down_proj"]["scale_dtype"] == "float16"  # exact for Q8_0/Q5_0 here
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["max_denoising_steps"] == 48 and gen["entropy_bound"] == 0.1
    tok = json.loads((tiny_model_dir / "tokenizer_gguf.json").read_text())
    assert tok["tokenizer.ggml.model"] == "gemma4" and len(tok["tokenizer.ggml.tokens"]) == 512
    assert tok["tokenizer.ggml.tokens"][106] == "<turn|>"
    assert "<|turn>" in (tiny_model_dir / "chat_template.jinja").read_text()


def test_every_weight_is_exact_and_mlx_loads_it(tiny_model_dir, tiny_gguf):
    report = verify(tiny_model_dir, tiny_gguf)
    assert report.ok and report.exact == report.checked == 75
    weights = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    _, mapped = open_model_dir(tiny_model_dir)
    assert set(weights) == set(mapped)
    for k, v in weights.items():
        assert np.array_equal(np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v),
                              np.asarray(mapped[k]) if mapped[k].dtype != np.uint16 else np.array(v)), k
    # experts are stacked [E, out, packed] and contiguous per expert
    assert weights["layers.0.experts.gate_up_proj.weight"].shape[0] == 8


def test_all_types_convert_exactly(all_types_model_dir, all_types_gguf):
    report = verify(all_types_model_dir, all_types_gguf)
    assert report.ok, report.mismatches
    types = {v["ggml_type"] for k, v in json.loads((all_types_model_dir / "config.json").read_text())
             ["quantization"].items() if isinstance(v, dict)}
    assert types == {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}


def test_sharding_and_index(tmp_path, tiny_gguf):
    out = tmp_path / "sharded"
    convert(tiny_gguf, out, max_shard_bytes=300_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(s.stat().st_size for s in shards)
    assert verify(out, tiny_gguf).ok


def test_compact_is_smaller_and_reports_its_error(tmp_path, all_types_gguf, all_types_model_dir):
    out = tmp_path / "compact"
    report = convert(all_types_gguf, out, compact=True)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(out) < size(all_types_model_dir)
    assert report.max_abs_error and max(report.max_abs_error.values()) > 0
    assert max(report.max_abs_error.values()) < 5e-3
    v = verify(out, all_types_gguf)
    assert v.lossy and v.ok  # lossy, recomputed from the GGUF and found identical
    assert v.exact < v.checked and v.max_abs_error
    for name, err in v.max_abs_error.items():  # and the converter's own report agrees
        assert err == pytest.approx(report.max_abs_error[name], rel=1e-6, abs=1e-9)
    assert report.by_type["Q6_K"].mlx_bpw == pytest.approx(9.0)
    assert report.by_type["Q4_K"].mlx_bpw == pytest.approx(5.0)


def test_cli_convert_verify_force(tmp_path, tiny_gguf, capsys):
    out = tmp_path / "cli"
    assert main(["convert", str(tiny_gguf), str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "all exact" in text and "Q6_K" in text
    assert main(["convert", str(tiny_gguf), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(tiny_gguf), str(out), "--force", "--compact"]) == 0
    assert json.loads((out / "config.json").read_text())["mlx_dgemma"]["weights"] == "fast"  # its alias
    assert main(["verify", str(out), str(tiny_gguf)]) == 0
    assert "a fast directory" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["cli"]


def test_verify_with_its_arguments_swapped_says_so(tiny_gguf, tiny_model_dir, capsys):
    # it said only "DIR: is a directory, not a file; give the path of a DiffusionGemma .gguf file"
    assert main(["verify", str(tiny_gguf), str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mlx-dgemma verify: error: {tiny_gguf} and {tiny_model_dir}: the other way round; the converted "
                   f"directory comes first: mlx-dgemma verify {tiny_model_dir} {tiny_gguf}"), err


def test_gguf_loads_in_memory_like_the_converted_directory(all_types_gguf, all_types_model_dir):
    from mlx_dgemma import load

    ra, rb = load(all_types_gguf), load(all_types_model_dir)
    (a, tok_a), (b, tok_b) = (ra.model, ra.tokenizer), (rb.model, rb.tokenizer)
    prompt = mx.array([list(range(5, 30))], dtype=mx.int32)
    canvas = mx.array([list(range(100, 132))], dtype=mx.int32)
    outs = []
    for m in (a, b):
        cache = m.make_cache()
        m.prefill(prompt, cache)
        outs.append(np.array(m.denoise(canvas, cache)))
    assert np.array_equal(outs[0], outs[1])
    assert tok_a.encode("Hello <|turn>") == tok_b.encode("Hello <|turn>")
    assert ra.generation_config == rb.generation_config
