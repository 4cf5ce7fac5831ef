"""The GGUF header read from the pre-scan's walk (convert/header.py) against gguf-py's reader:
the same value for every metadata key, the same tensor table, the same tensor bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFWriter

from mlx_dgemma.convert.metadata import field_kinds, field_value, read_metadata
from mlx_dgemma.convert.source import open_gguf
from mlx_dgemma.demo import demo_file


def _gguf_py_value(f):
    """A field's value as gguf-py's reader decodes it (its ``contents()``)."""
    return f.contents()


def _same_as_gguf_py(path, reader: GGUFReader) -> int:
    header = open_gguf(path, architecture=None)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert header.keys() == keys  # every key, in file order
    for k in keys:
        ours, theirs = header.value(k), _gguf_py_value(reader.fields[k])
        assert type(ours) is type(theirs) and ours == theirs, k
        if isinstance(ours, list) and ours:
            assert type(ours[0]) is type(theirs[0]), k  # float stays float, bool stays bool
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(x) for x in theirs.shape)
        assert (ours.n_elements, ours.n_bytes, ours.data_offset) == (theirs.n_elements, theirs.n_bytes,
                                                                     theirs.data_offset)
        a, b = ours.data, np.asarray(theirs.data)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True), ours.name
    assert header.data_offset == reader.data_offset
    return len(keys)


def test_real_llama_cpp_file_reads_as_gguf_py_reads_it(gemma3_gguf, gemma3_reader):
    """Gemma 3 270M Q4_K_M as llama.cpp wrote it: a 262k-token vocabulary, merges, scores, types,
    Q4_K/Q6_K/Q8_0/F32 tensors."""
    assert _same_as_gguf_py(gemma3_gguf, gemma3_reader) > 20


def test_demo_file_reads_as_gguf_py_reads_it():
    path = demo_file("trained")
    assert _same_as_gguf_py(path, GGUFReader(path)) > 20


def test_tiny_model_reads_as_gguf_py_reads_it(tiny_gguf):
    assert _same_as_gguf_py(tiny_gguf, GGUFReader(tiny_gguf)) > 20


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path):
    """Each scalar type, arrays of numbers, booleans and strings, non-ASCII strings (gguf-py's
    writer refuses empty arrays; the scan's tests hold those)."""
    path = tmp_path / "types.gguf"
    w = GGUFWriter(path, "diffusion-gemma")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "grüße, 世界")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ü"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFReader(path)
    assert _same_as_gguf_py(path, reader) == 17  # general.architecture and the 16 above
    header = open_gguf(path, architecture=None)
    # the float32 value is the file's float32, as gguf-py gives it (not 0.1)
    assert header.value("t.f32") == float(np.float32(0.1)) and header.value("t.f64") == 0.1
    # the validation's view: types and counts
    assert field_kinds(header)["t.ints"] == ("array", "int32", 3)
    assert field_kinds(header)["t.strs"] == ("array", "string", 3)
    assert read_metadata(header)["t.strs"] == ["a", "", "ü"]


def test_long_arrays_are_summarized_unless_asked_for_whole(tmp_path):
    path = tmp_path / "long.gguf"
    w = GGUFWriter(path, "diffusion-gemma")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = open_gguf(path, architecture=None)
    assert field_value(header, "tokenizer.ggml.tokens") == "<array of 5000>"
    whole = field_value(header, "tokenizer.ggml.tokens", full=True)
    assert len(whole) == 5000 and whole[4999] == "t4999"
