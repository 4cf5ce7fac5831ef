"""The ggml type table (mlx_dgemma/formats.py): each type's facts declared once, and a new type
is its row there and its block class in convert/quants.py, nothing else (issue 34's row "new
ggml type": 2 edits / 2 files)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlx_dgemma import formats, tiers
from mlx_dgemma.cli import main
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.quants import FORMATS, BlockFormat, Split, _f16, supported_types
from mlx_dgemma.convert.synthetic import TinySpec, plan_types, write_tiny_gguf
from mlx_dgemma.convert.verify import verify
from mlx_dgemma.formats import GGMLType
from mlx_dgemma.loader import model_inventory
from mlx_dgemma.validate import check_safetensors
from tests.hostile_util import promise


@pytest.fixture
def tq2_0(monkeypatch):
    """llama.cpp's ternary TQ2_0 (w = d * (q - 1), 2-bit q, one float16 d a 256-element block),
    declared the way a new type is: a row in formats.TYPES and a block class. Both are gone after
    the test."""
    monkeypatch.setitem(formats.TYPES, "TQ2_0", GGMLType("TQ2_0", 2))

    class TQ2_0(BlockFormat, qtype=T.TQ2_0):
        """block_tq2_0 { u8 qs[64]; f16 d; }  w = d * (q - 1), qs as in Q2_K"""

        fp16_fields = (64, None, 0)

        @classmethod
        def split(cls, blocks):
            n = blocks.shape[0]
            qs, d = np.hsplit(blocks, [64])
            shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
            q = ((qs.reshape(n, 2, 1, 32) >> shift) & np.uint8(3)).reshape(n, 256)
            d = np.repeat(_f16(d), 8, axis=1)  # one scale for the block's eight groups of 32
            return Split(q, d, -d)

    try:
        yield TQ2_0
    finally:
        del FORMATS[T.TQ2_0]


def test_a_new_type_is_its_row_and_its_class(tmp_path, capsys, tq2_0):
    # the converter reads it: the supported set, the synthetic writer's `all` cycle
    assert T.TQ2_0 in supported_types()
    gguf = write_tiny_gguf(tmp_path / "all.gguf", TinySpec(), types="all", seed=1)
    assert T.TQ2_0 in plan_types(TinySpec().text_config(), "all").values()
    out = tmp_path / "m"
    convert(gguf, out)
    # bit-exact against gguf-py's dequantizer, through config.json's checks (validate)
    report = verify(out, gguf)
    assert report.ok, report.mismatches
    specs = {k: v for k, v in json.loads((out / "config.json").read_text())["quantization"].items()
             if isinstance(v, dict) and v["ggml_type"] == "TQ2_0"}
    assert specs and all(v["bits"] == 2 and v["subblock"] == 32 for v in specs.values())
    # the memory plan prices it at the bytes the converter wrote
    header = check_safetensors(out / "model.safetensors")
    stored = {m: sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                     if k.rsplit(".", 1)[0] == m) for m in specs}
    args, inventory, _ = model_inventory(out)
    priced = {i.module: tiers.tensor_bytes(i, "exact", args.num_hidden_layers) for i in inventory
              if i.ggml_type == "TQ2_0"}
    assert priced == stored
    # and the command line plans it
    code, line = promise(["plan", str(out)], capsys, tmp_path, {"all.gguf", "m"})
    assert code == 0, line


def test_a_class_needs_its_row_and_its_type_one_class():
    with pytest.raises(TypeError, match="TQ1_0 needs its quantized row in mlx_dgemma.formats.TYPES"):
        class TQ1_0(BlockFormat, qtype=T.TQ1_0):
            fp16_fields = (0, None, 0)

            @classmethod
            def split(cls, blocks):
                raise NotImplementedError
    with pytest.raises(TypeError, match="Q4_0 already has its class, Q4_0"):
        class Again(BlockFormat, qtype=T.Q4_0):
            fp16_fields = (0, None, 0)

            @classmethod
            def split(cls, blocks):
                raise NotImplementedError
    assert FORMATS[T.Q4_0].__name__ == "Q4_0" and T.TQ1_0 not in FORMATS


def test_every_quantized_row_has_its_class_with_the_rows_facts():
    rows = {n: t for n, t in formats.TYPES.items() if t.quantized}
    assert {q.name for q in FORMATS} == set(rows)
    for qtype, cls in FORMATS.items():
        assert (cls.bits, cls.subblock) == (rows[qtype.name].bits, rows[qtype.name].subblock)


@pytest.mark.parametrize("row", [dict(bits=4, float_bytes=2), dict(), dict(bits=4, paired=True),
                                 dict(bits=4, subblock=8)], ids=["both", "neither", "paired-unpadded", "subblock-8"])
def test_a_wrong_row_fails_when_declared(row):
    with pytest.raises(ValueError, match="ggml type row"):
        GGMLType("X", **row)


def test_lookup_names_the_known_types():
    assert formats.lookup("Q6_K").padded
    with pytest.raises(ValueError, match=r"unknown ggml type 'Q9_K' \(known: F32, Q4_K"):
        formats.lookup("Q9_K")


def test_config_with_an_unknown_ggml_type_is_one_line(tmp_path, capsys, tiny_model_dir):
    # before: a traceback, KeyError: 'Q9_K' from the plan's byte count (plan, generate, chat, serve)
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"]["self_conditioning.down_proj"]["ggml_type"] = "Q9_K"
    (d / "config.json").write_text(json.dumps(cfg))
    for argv in (["plan", str(d)], ["generate", "--model", str(d), "--prompt", "hi"]):
        code, line = promise(argv, capsys, tmp_path, {"m"})
        assert code == 2, line
        assert str(d / "config.json") in line and "quantization['self_conditioning.down_proj'].ggml_type" in line
        assert "'Q9_K'" in line and "Q6_K" in line and "convert the model again" in line
