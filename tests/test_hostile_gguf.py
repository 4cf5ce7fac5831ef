"""Hostile GGUFs and tampered converted directories, one per failure class of issue 9: each is
a one-line error naming the file and key/tensor, exit 2, nothing left behind, no hang."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from tests.hostile_util import kv_value_pos, promise, tensor_fields

P = "diffusion-gemma."


class BrokenSpec(TinySpec):
    """Tensors of the default tiny model, metadata edited by ``extra_metadata``."""

    def text_config(self):
        return TinySpec().text_config()


@pytest.fixture
def work(tmp_path) -> Path:
    return tmp_path


def convert_fails(work: Path, src: Path, capsys, *expect: str) -> str:
    code, line = promise(["convert", str(src), str(work / "out")], capsys, work, {src.name})
    assert code == 2, line
    for e in expect:
        assert e in line, line
    return line


def test_array_claiming_2_62_items_is_refused_at_once(work):
    # 58 bytes: header, one uint8 array of 2**62 items (before: memory grew ~50 MB/s forever)
    key = b"general.x"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IIQ", 9, 0, 2**62) + b"\0"
    src = work / "huge.gguf"
    src.write_bytes(data)
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma.cli", "convert", str(src), str(work / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "general.x" in r.stderr and "more than the file holds" in r.stderr


@pytest.mark.parametrize("key, value, expect", [
    (P + "block_count", "three", "expected an integer"),
    (P + "block_count", [3, 3], "expected an integer"),
    (P + "attention.layer_norm_rms_epsilon", "abc", "expected a finite number"),
    ("diffusion.eb_t_min", "warm", "diffusion.eb_t_min"),
    ("diffusion.canvas_length", 0, "diffusion.canvas_length"),
    (P + "attention.sliding_window", 0, "sliding_window"),
    (P + "expert_used_count", 9, "at most expert_count"),
    (P + "attention.head_count_kv", [1, 1], "3 integers"),
    ("tokenizer.ggml.unknown_token_id", 100000, "unknown_token_id"),
    ("tokenizer.ggml.model", "bpe", "expected 'gemma4' or 'llama'"),
    ("tokenizer.chat_template", "{% for x in %}", "does not compile"),
])
def test_bad_metadata_value(work, capsys, key, value, expect):
    spec = BrokenSpec(extra_metadata={key: value})
    src = work / "m.gguf"
    if key == "tokenizer.chat_template":
        write_tiny_gguf(src, TinySpec(), chat_template=value)
    elif key.startswith("tokenizer."):
        from mlx_dgemma.convert.tokenizer_data import synthetic_gemma4_vocab

        tok = synthetic_gemma4_vocab(512)
        tok[key] = value
        write_tiny_gguf(src, TinySpec(), tokenizer=tok)
    else:
        write_tiny_gguf(src, spec)
    line = convert_fails(work, src, capsys, str(src), expect)
    assert key in line or key.split(".")[-1] in line


@pytest.mark.parametrize("what", ["no tokens", "bad merges"])
def test_bad_tokenizer(work, capsys, what):
    from mlx_dgemma.convert.tokenizer_data import synthetic_gemma4_vocab

    tok = synthetic_gemma4_vocab(512)
    if what == "no tokens":
        tok["tokenizer.ggml.tokens"], tok["tokenizer.ggml.scores"], tok["tokenizer.ggml.token_type"] = [], [], []
    else:
        tok["tokenizer.ggml.merges"] = tok["tokenizer.ggml.merges"][:5] + ["nospace", "zz qq"]
    src = write_tiny_gguf(work / "m.gguf", TinySpec(), tokenizer=tok)
    convert_fails(work, src, capsys, str(src), "tokenizer.ggml.")


def test_duplicate_key_and_bad_utf8(work, capsys, tiny_gguf):
    data = tiny_gguf.read_bytes()
    src = work / "m.gguf"
    src.write_bytes(data.replace(b"general.name", b"general.type", 1))  # two keys named general.type
    convert_fails(work, src, capsys, "appears twice")
    i, v = kv_value_pos(data, "general.name")
    bad = bytearray(data)
    bad[v + 8] = 0xFF  # first byte of the name's text
    src.write_bytes(bytes(bad))
    convert_fails(work, src, capsys, "not valid UTF-8")


@pytest.mark.parametrize("data, expect", [
    (b"", "the file is empty (0 bytes), not a GGUF; download the .gguf model file again"),
    (b"GGUF", "4 bytes is too short for a GGUF header; the file is truncated"),
    (b"<!DOCTYPE html>", "not a GGUF file (starts with b'<!DO', expected b'GGUF')"),
])
def test_an_empty_short_or_other_file_says_what_it_is(work, capsys, data, expect):
    src = work / "m.gguf"
    src.write_bytes(data)
    line = convert_fails(work, src, capsys, expect)
    assert str(src) in line


@pytest.mark.parametrize("edit, expect", [
    ("wrap", "past the end"),  # an offset that wraps around 2**64
    ("same", "overlap"),  # two tensors at one offset
    ("misaligned", "alignment"),
    ("relabel", "overlap"),  # a Q4_K tensor relabelled F32: 8x the bytes
])
def test_tensor_table(work, capsys, tiny_gguf, edit, expect):
    data = bytearray(tiny_gguf.read_bytes())
    t, off = tensor_fields(bytes(data), "blk.0.ffn_up.weight")
    _, off0 = tensor_fields(bytes(data), "blk.0.ffn_gate.weight")
    if edit == "wrap":
        data[off:off + 8] = struct.pack("<Q", 2**64 - 32)
    elif edit == "same":
        data[off:off + 8] = data[off0:off0 + 8]
    elif edit == "misaligned":
        (o,) = struct.unpack_from("<Q", data, off)
        data[off:off + 8] = struct.pack("<Q", o + 4)
    else:
        assert struct.unpack_from("<I", data, t)[0] != 0
        data[t:t + 4] = struct.pack("<I", 0)  # F32
    src = work / "m.gguf"
    src.write_bytes(bytes(data))
    convert_fails(work, src, capsys, str(src), expect)


def poisoned_gguf(path, tensor: str, value: float):
    """A float32 tiny GGUF whose ``tensor`` starts with ``value`` (NaN or Inf)."""
    from mlx_dgemma.convert.scan import scan_gguf

    src = write_tiny_gguf(path, TinySpec(), types="f32")
    data = bytearray(src.read_bytes())
    start = next(t.offset for t in scan_gguf(src, None).tensors if t.name == tensor)
    data[start:start + 4] = np.float32(value).tobytes()
    src.write_bytes(bytes(data))
    return src


def test_nan_weight_is_named(work, capsys):
    src = poisoned_gguf(work / "m.gguf", "blk.1.attn_norm.weight", float("nan"))
    convert_fails(work, src, capsys, "'blk.1.attn_norm.weight'", "NaN or Inf")


def test_verify_against_another_model(work, capsys, tiny_model_dir):
    other = write_tiny_gguf(work / "other.gguf", TinySpec(hidden_size=128, moe_intermediate_size=32))
    code, line = promise(["verify", str(tiny_model_dir), str(other)], capsys, work, {"other.gguf"})
    assert code == 2 and "different model" in line and "hidden_size" in line
    arch = work / "arch.gguf"
    arch.write_bytes(other.read_bytes().replace(b"diffusion-gemma", b"diffusion-gemmX", 1))
    code, line = promise(["verify", str(tiny_model_dir), str(arch)], capsys, work, {"other.gguf", "arch.gguf"})
    assert code == 2 and "general.architecture" in line


# --- tampered converted directories -------------------------------------------------------

def _spoil_json(path, garbage: str | None, edit) -> str:
    """Overwrite a JSON side file with ``garbage``, or with its parsed content after ``edit``."""
    if garbage is not None:
        path.write_text(garbage)
    else:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return path.name


def _st_header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return n, json.loads(raw[8:8 + n])


def _put_header(path: Path, header: dict, n: int) -> None:
    raw = bytearray(path.read_bytes())
    h = json.dumps(header).encode()
    assert len(h) <= n
    raw[8:8 + n] = h + b" " * (n - len(h))
    path.write_bytes(bytes(raw))


def _tamper(d: Path, what: str) -> str:
    """Break one thing in converted directory ``d``; returns the file the error must name."""
    cfg = json.loads((d / "config.json").read_text())
    st = d / "model.safetensors"
    if what.startswith("config:"):
        kind = what.split(":", 1)[1]
        tc = cfg["text_config"]
        if kind == "invalid":
            (d / "config.json").write_text("{not json")
            return "config.json"
        if kind == "array":
            (d / "config.json").write_text("[1, 2]")
            return "config.json"
        {"missing": lambda: tc.pop("hidden_size"), "mistyped": lambda: tc.update(hidden_size="256"),
         "huge_layers": lambda: tc.update(num_hidden_layers=10**9),
         "group_size": lambda: cfg["quantization"].update(group_size=7),
         "layer_types": lambda: tc.update(layer_types=["weird"] * tc["num_hidden_layers"]),
         "top_k": lambda: tc.update(top_k_experts=99)}[kind]()
        (d / "config.json").write_text(json.dumps(cfg))
        return "config.json"
    if what.startswith("st:"):
        kind = what.split(":", 1)[1]
        n, h = _st_header(st)
        name = next(k for k in h if k != "__metadata__")
        if kind == "truncated":
            st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        elif kind == "offsets":
            h[name]["data_offsets"] = [0, 10**12]
            _put_header(st, h, n)
        elif kind == "header":
            raw = bytearray(st.read_bytes())
            raw[8:16] = b"\x00garbage"
            st.write_bytes(bytes(raw))
        elif kind == "dtype":
            h[name]["dtype"] = "Q9"
            _put_header(st, h, n)
        elif kind == "huge_header":
            raw = bytearray(st.read_bytes())
            raw[:8] = struct.pack("<Q", 2**62)
            st.write_bytes(bytes(raw))
        return "model.safetensors"
    if what == "foreign_shard":
        shutil.copy(st, d / "extra.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: "model.safetensors" for k in _st_header(st)[1] if k != "__metadata__"}}))
        return "extra.safetensors"
    if what == "index":
        (d / "model.safetensors.index.json").write_text("{]")
        return "model.safetensors.index.json"
    if what.startswith("tok:"):
        kind = what.split(":", 1)[1]

        def bad_tokens(tok: dict) -> None:
            if kind == "mistyped":
                tok["tokenizer.ggml.tokens"] = 5
            if kind == "unk":
                tok["tokenizer.ggml.unknown_token_id"] = 10**6
            if kind == "model":
                tok["tokenizer.ggml.model"] = "bpe"

        return _spoil_json(d / "tokenizer_gguf.json", "\x00\x01" if kind == "invalid" else None, bad_tokens)
    if what.startswith("gen:"):
        kind = what.split(":", 1)[1]
        return _spoil_json(d / "generation_config.json", "nope" if kind == "invalid" else None,
                           lambda gen: gen.__setitem__("t_min", "warm"))
    if what == "template":
        (d / "chat_template.jinja").write_text("{% if %}")
        return "chat_template.jinja"
    raise AssertionError(what)


TAMPERS = ["config:invalid", "config:array", "config:missing", "config:mistyped", "config:huge_layers",
           "config:group_size", "config:layer_types", "config:top_k", "st:truncated", "st:offsets",
           "st:header", "st:dtype", "st:huge_header", "foreign_shard", "index", "tok:invalid", "tok:mistyped",
           "tok:unk", "tok:model", "gen:invalid", "gen:mistyped", "template"]


@pytest.mark.parametrize("what", TAMPERS)
def test_tampered_directory(work, capsys, tiny_model_dir, tiny_gguf, what):
    d = work / "m"
    shutil.copytree(tiny_model_dir, d)
    fname = _tamper(d, what)
    code, line = promise(["generate", "--model", str(d), "--prompt", "hi", "--steps", "2", "--max-tokens", "8"],
                         capsys, work, {"m"})
    assert code == 2 and fname in line, line
    code, line = promise(["verify", str(d), str(tiny_gguf)], capsys, work, {"m"})
    assert code == 2 and fname in line, line


def test_nan_weight_is_named_when_loading_a_gguf(work, capsys):
    src = poisoned_gguf(work / "m.gguf", "output_norm.weight", float("inf"))
    code, line = promise(["generate", "--model", str(src), "--prompt", "hi"], capsys, work, {"m.gguf"})
    assert code == 2 and str(src) in line and "'output_norm.weight'" in line and "NaN or Inf" in line
