"""Metadata written with GGUF value types other than the ones gguf-py's writer picks (uint32,
float32): llama.cpp's tools and third-party writers use uint64, int32, float64, uint8... The
error names the key, the type found and the type expected (before: a misleading "truncated or
corrupt", a value the file does not hold, or "expected 512 numbers" for 512 numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFValueType as V

import mlx_dgemma.convert.synthetic as synthetic
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from tests.hostile_util import promise


def typed_gguf(path: Path, monkeypatch, key: str, vtype: V, value, sub_type: V | None = None) -> Path:
    """The tiny model's GGUF with ``key`` written as ``vtype`` (an array of ``sub_type``)."""
    add = synthetic._add_kv

    def typed(w, k, v):
        if k != key:
            return add(w, k, v)
        w.add_key_value(k, value, vtype, sub_type=sub_type)

    monkeypatch.setattr(synthetic, "_add_kv", typed)
    spec = TinySpec(extra_metadata={} if key.startswith("tokenizer.") else {key: 0})
    return write_tiny_gguf(path, spec)


@pytest.mark.parametrize("vtype, value, sub, got", [
    (V.UINT64, 32, None, "a uint64"),  # was "truncated or corrupt, download it again"
    (V.UINT8, 32, None, "a uint8"),
    (V.INT32, 32, None, "an int32"),  # was "general.alignment = -1", a value the file does not hold
    (V.FLOAT32, 32.0, None, "a float32"),
    (V.STRING, "32", None, "a string"),
    (V.ARRAY, [32], V.UINT32, "an array of uint32"),
])
def test_alignment_of_another_type_is_named(tmp_path, monkeypatch, capsys, vtype, value, sub, got):
    src = typed_gguf(tmp_path / "m.gguf", monkeypatch, "general.alignment", vtype, value, sub)
    code, line = promise(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path, {src.name})
    assert code == 2
    assert f"general.alignment is {got}, expected a uint32" in line, line


@pytest.mark.parametrize("key, sub, value", [
    ("tokenizer.ggml.scores", V.FLOAT64, 0.0),
    ("tokenizer.ggml.token_type", V.UINT8, 1),
])
def test_a_per_token_array_of_another_type_is_named(tmp_path, monkeypatch, capsys, key, sub, value):
    vocab = TinySpec().vocab_size
    src = typed_gguf(tmp_path / "m.gguf", monkeypatch, key, V.ARRAY, [value] * vocab, sub)
    code, line = promise(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path, {src.name})
    assert code == 2
    assert f"{key}: expected an array of {vocab} numbers" in line and f"got {vocab} {sub.name.lower()}" in line, line


def test_alignment_as_uint32_still_converts(tmp_path, monkeypatch, capsys):
    src = typed_gguf(tmp_path / "m.gguf", monkeypatch, "general.alignment", V.UINT32, 32)
    code, line = promise(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path, {src.name, "out"})
    assert code == 0, line
