"""The hostile-input rerun of issue 24 (validation, verify, chat template, generation rules):
each case a one-line error naming the file, key, tensor, message or flag, with the real
limit, non-zero exit and nothing left behind. The bench's cases are in test_bench.py."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from mlx_dgemma.chat_template import PROMPT_CHARS, RENDER_CHARS, render_chat
from mlx_dgemma.cli import main
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.params import GENERATION_RULES, check_generation_field
from tests.hostile_util import promise
from tests.test_hostile_gguf import poisoned_gguf


@pytest.fixture
def work(tmp_path) -> Path:
    return tmp_path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- verify

@pytest.mark.parametrize("key, value", [("bits", 8), ("bits", 2), ("group_size", 64)])
def test_verify_of_a_config_with_another_bit_width(work, capsys, tiny_model_dir, tiny_gguf, key, value):
    # before: a traceback, ValueError: [dequantize] Shape of scales and biases does not match...
    d = _copy(tiny_model_dir, work / "m")
    module = "self_conditioning.down_proj"
    _edit_config(d, lambda c: c["quantization"][module].update({key: value}))
    code, line = promise(["verify", str(d), str(tiny_gguf)], capsys, work, {"m"})
    assert code == 2, line
    assert str(d / "config.json") in line and f"quantization['{module}']" in line and f"'{module}.weight'" in line
    assert f"{key} {value}" in line and "convert the model again" in line
    # loading names the same mismatch, before any weight is read
    code, line = promise(["generate", "--model", str(d), "--prompt", "hi"], capsys, work, {"m"})
    assert code == 2 and f"quantization['{module}']" in line


def _poison_safetensors(d: Path, name: str, count: int | None) -> None:
    """Set the first ``count`` values (all when None) of float32 tensor ``name`` to NaN."""
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    e = json.loads(data[8:8 + n])[name]
    assert e["dtype"] == "F32"
    a, b = e["data_offsets"]
    k = (b - a) // 4 if count is None else count
    data[8 + n + a:8 + n + a + 4 * k] = np.full(k, np.nan, np.float32).tobytes()
    path.write_bytes(bytes(data))


def test_verify_reports_nan_as_a_mismatch_without_a_warning(work, capsys, tiny_model_dir, tiny_gguf):
    # before: "RuntimeWarning: All-NaN slice" leaked and both tensors said "max abs error 0"
    d = _copy(tiny_model_dir, work / "m")
    _poison_safetensors(d, "norm.weight", None)  # every value NaN
    _poison_safetensors(d, "layers.0.input_layernorm.weight", 1)  # one value NaN
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a leaked NumPy warning fails the test
        code = main(["verify", str(d), str(tiny_gguf)])
    out = capsys.readouterr().out
    assert code == 1
    mismatches = [ln for ln in out.splitlines() if ln.startswith("MISMATCH")]
    assert len(mismatches) == 2, out
    by_name = {ln.split()[1].rstrip(":"): ln for ln in mismatches}
    assert set(by_name) == {"output_norm.weight", "blk.0.attn_norm.weight"}, out
    assert "256 NaN here" in by_name["output_norm.weight"] and "1 NaN here" in by_name["blk.0.attn_norm.weight"]
    assert "error 0" not in out and "2 tensor(s) differ" in out


# --------------------------------------------------------------------------- GGUF values

@pytest.mark.parametrize("value, where", [(float("nan"), 0), (float("nan"), -1), (float("inf"), 0),
                                          (float("-inf"), -1)])
def test_non_finite_rope_freqs_is_named(work, capsys, value, where):
    # before: NaN (and Inf in the rotated prefix) said "other frequency factors are not supported"
    src = write_tiny_gguf(work / "m.gguf", TinySpec(), types="f32")
    from mlx_dgemma.convert.scan import scan_gguf

    info = next(t for t in scan_gguf(src, None).tensors if t.name == "rope_freqs.weight")
    data = bytearray(src.read_bytes())
    pos = info.offset + (0 if where == 0 else info.n_bytes - 4)
    data[pos:pos + 4] = np.float32(value).tobytes()
    src.write_bytes(bytes(data))
    for argv in (["convert", str(src), str(work / "out")], ["generate", "--model", str(src), "--prompt", "hi"]):
        code, line = promise(argv, capsys, work, {"m.gguf"})
        assert code == 2 and str(src) in line and "'rope_freqs.weight'" in line and "NaN or Inf" in line, line
        assert "not supported" not in line


def test_poisoned_gguf_helper_still_reaches_rope_freqs(work, capsys):
    # the shared helper of test_hostile_gguf on this tensor: the same one-line answer
    src = poisoned_gguf(work / "m.gguf", "rope_freqs.weight", float("nan"))
    code, line = promise(["convert", str(src), str(work / "out")], capsys, work, {"m.gguf"})
    assert code == 2 and "'rope_freqs.weight'" in line and "NaN or Inf" in line


def test_canvas_longer_than_the_context_names_the_key(work, capsys):
    # before: "prompt: 23 tokens plus 4 block(s) of 64 exceed the context of 48; shorten the prompt"
    src = write_tiny_gguf(work / "m.gguf", TinySpec(canvas_length=64, context_length=48), types="f32")
    for argv in (["convert", str(src), str(work / "out")], ["generate", "--model", str(src), "--prompt", "hi"]):
        code, line = promise(argv, capsys, work, {"m.gguf"})
        assert code == 2 and "diffusion.canvas_length = 64" in line and "context_length = 48" in line, line
        assert "at most 47" in line


def test_converted_canvas_longer_than_the_context_names_the_key(work, capsys, tiny_model_dir):
    d = _copy(tiny_model_dir, work / "m")
    _edit_config(d, lambda c: c.update(canvas_length=c["text_config"]["max_position_embeddings"]))
    code, line = promise(["generate", "--model", str(d), "--prompt", "hi"], capsys, work, {"m"})
    ctx = json.loads((d / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert code == 2 and str(d / "config.json") in line and f"canvas_length = {ctx}" in line, line
    assert "text_config.max_position_embeddings" in line and f"at most {ctx - 1}" in line


# --------------------------------------------------------------------------- prompts

def test_a_huge_user_message_is_named_not_the_template():
    # before: "chat template: rendering exceeded its budget ...; the template loops too much"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 10_000_000}]
    with pytest.raises(ParameterError) as e:
        render_chat(msgs)
    msg = str(e.value)
    assert msg.startswith("messages[1]: the user message has 10,000,000 characters") and "template" not in msg
    assert f"{PROMPT_CHARS:,}" in msg and e.value.param == "messages"


def test_a_huge_message_in_parts_is_counted():
    parts = [{"type": "text", "text": "y" * 1_000_000}] * 5
    with pytest.raises(ParameterError, match=r"messages\[0\]: the user message has 5,000,000 characters"):
        render_chat([{"role": "user", "content": parts}])


def test_a_long_message_within_the_limit_is_not_blamed_on_the_template():
    # the template's own text comes on top of the message's: a prompt at the limit renders
    text = "z" * PROMPT_CHARS
    template = "{% for m in messages %}{{ '<turn>' * 50 }}{{ m['content'] }}{% endfor %}"
    assert len(render_chat([{"role": "user", "content": text}], template)) == PROMPT_CHARS + 300
    with pytest.raises(ParameterError, match="the template loops too much"):  # its own output still bounded
        render_chat([{"role": "user", "content": "hi"}], "{{ 'x' * %d }}" % (RENDER_CHARS + 10))


def test_a_huge_prompt_through_generation_is_named(tiny_model_dir):
    from mlx_dgemma import load, stream_generate

    rt = load(tiny_model_dir)
    model, tok = rt.model, rt.tokenizer
    with pytest.raises(ParameterError, match=r"^messages\[0\]: the user message has 5,000,000 characters"):
        list(stream_generate(rt, "w " * 2_500_000, max_new_tokens=8))


# --------------------------------------------------------------------------- generation rules

def test_entropy_bound_states_the_real_limit(work, capsys):
    # before: "--entropy-bound 1e-300: must be a number > 0 (finite)" although the limit is 1e-12
    code = main(["generate", "--model", str(work / "nope"), "--prompt", "hi", "--entropy-bound", "1e-300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["mlx-dgemma generate: error: --entropy-bound 1e-300: must be a number in "
                                 "[1e-12, 1e9]"], err


def _just_outside(kind: str, low, high) -> list:
    if kind == "int":
        return [low - 1, high + 1]
    return [low / 2 if low > 0 else -1.0, high * 2]


def _shown(v) -> list[str]:
    """How a rule text may write a bound: 1e-12, 1000, 10000000, 2**31 - 1."""
    out = [f"{v:g}", f"{v:g}".replace("e+0", "e").replace("e+", "e"), str(v)]
    for p in (31, 63, 64):
        if v == 2**p - 1:
            out.append(f"2**{p} - 1")
    return out


@pytest.mark.parametrize("name", sorted(GENERATION_RULES))
def test_every_generation_rule_states_its_true_range(name):
    kind, low, high, text = GENERATION_RULES[name]
    check_generation_field(name, low)  # the bounds themselves are accepted
    check_generation_field(name, high)
    for bad in _just_outside(kind, low, high):
        with pytest.raises(ParameterError) as e:
            check_generation_field(name, bad)
        assert e.value.rule == text and str(e.value).endswith(f"must be {text}")
    assert any(s in text for s in _shown(low)), (name, text)
    # sc_top_k's upper limit is the vocabulary's size, known once a model is loaded
    assert any(s in text for s in _shown(high)) or "vocabulary size" in text, (name, text)


def test_a_refused_chat_message_is_not_kept(tiny_model_dir):
    # before: the refused message stayed in the conversation, so every later first turn failed on it
    from mlx_dgemma import load
    from mlx_dgemma.events import DoneEvent
    from mlx_dgemma.generation import ChatSession

    rt = load(tiny_model_dir)
    model, tok = rt.model, rt.tokenizer
    chat = ChatSession(rt, system="be brief")
    with pytest.raises(ParameterError, match=r"^messages\[1\]: the user message"):
        list(chat.stream("v" * (PROMPT_CHARS + 1)))
    assert chat.messages == [{"role": "system", "content": "be brief"}]
    events = list(chat.stream("hi", max_new_tokens=8, max_denoising_steps=2, seed=0))
    assert isinstance(events[-1], DoneEvent) and [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
