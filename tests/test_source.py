"""GGUFSource: one GGUF opened once, written to disk by convert() and loaded in memory by
load_gguf, with the same names, specs and arrays on both sides."""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma.convert import GGUFSource
from mlx_dgemma.convert.errors import ConvertError
from mlx_dgemma.loader import load_dir, load_gguf


def _without_sidecar(config: dict) -> tuple[dict, dict | None]:
    """config.json less its record of fast's sidecar, and the record: the sidecar is a file of
    an exact directory (mlx_dgemma.sidecar), which a model loaded from the .gguf has not."""
    rest = json.loads(json.dumps(config))
    return rest, rest["mlx_dgemma"].pop("fast_sidecar", None)


def test_names_and_quantization_keys_agree_with_the_converted_directory(tiny_gguf, tiny_model_dir):
    config, sidecar = _without_sidecar(json.loads((tiny_model_dir / "config.json").read_text()))
    assert sidecar is not None and (tiny_model_dir / sidecar["file"]).is_file()
    index = json.loads((tiny_model_dir / "model.safetensors.index.json").read_text())
    with GGUFSource(tiny_gguf) as source:
        planned = source.stored_names()  # known before converting (the writer reserves headers by it)
        tensors = list(source.tensors())
        got = [name for c in tensors for name in c.arrays]  # produced: each spec's scale dtype is now known
        assert source.config({c.module: c.spec for c in tensors if c.spec}, "exact") == config
    assert got == planned and set(got) == set(index["weight_map"])
    specs = {k for k, v in config["quantization"].items() if isinstance(v, dict)}
    assert {c.module for c in tensors if c.spec is not None} == specs
    assert all(f"{c.module}.scales" in c.arrays for c in tensors if c.spec is not None)


def test_load_gguf_holds_exactly_the_converted_directorys_weights(all_types_gguf, all_types_model_dir):
    seen = []
    a, config_a, side = load_gguf(all_types_gguf, progress=lambda i, n, name: seen.append((i, n, name)))
    b, config_b = load_dir(all_types_model_dir)
    assert config_a == _without_sidecar(config_b)[0]
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(np.array(pa[k].astype(mx.float32)),
                                                             np.array(pb[k].astype(mx.float32))), k
    assert side["generation_config"] == json.loads((all_types_model_dir / "generation_config.json").read_text())
    assert side["tokenizer"] == json.loads((all_types_model_dir / "tokenizer_gguf.json").read_text())
    n = len(seen)
    assert [i for i, _, _ in seen] == list(range(1, n + 1)) and {m for _, m, _ in seen} == {n}


def test_a_file_cut_short_while_read_is_an_error_not_a_crash(tmp_path, tiny_gguf):
    # tensors are read with read(), not through the memory map: no SIGBUS, for load as for convert
    path = shutil.copy(tiny_gguf, tmp_path / "m.gguf")
    with GGUFSource(path) as source:
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(ConvertError, match="the file changed during conversion"):
            for _ in source.tensors():
                pass
