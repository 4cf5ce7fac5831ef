"""The converter's expected inventory, derived from the published header's metadata only,
equals that header's tensor list: names, shapes and ggml types, in order."""

import json
from pathlib import Path

import pytest

from mlx_dgemma.convert.metadata import args_from_metadata, generation_config
from mlx_dgemma.convert.names import NAME_MAP, expected_tensors, mlx_name, q4_k_m_types

# The published file's header, kept in the repository (source: tests/data/README.md).
HEADER = Path(__file__).resolve().parent / "data" / "diffusiongemma-26b-a4b-it-q4_k_m.header.json"


@pytest.fixture(scope="module")
def header():
    return json.loads(HEADER.read_text())


def test_inventory_matches_published_header(header):
    md = header["metadata"]
    cfg = args_from_metadata(md, vocab_size=262144)
    exp = expected_tensors(cfg)
    types = q4_k_m_types(exp)
    ours = [(e.name, list(e.ne), types[e.name].name) for e in exp]
    theirs = [(t["name"], t["ne"], t["type"]) for t in header["tensors"]]
    assert len(theirs) == 692
    assert ours == theirs


def test_config_from_published_metadata(header):
    cfg = args_from_metadata(header["metadata"], vocab_size=262144)
    assert cfg.layer_types.count("full_attention") == 5
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert (cfg.head_dim, cfg.global_head_dim) == (256, 512)
    assert (cfg.num_key_value_heads, cfg.num_global_key_value_heads) == (8, 2)
    assert cfg.sliding_window == 1024 and cfg.num_experts == 128 and cfg.top_k_experts == 8
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    gen = generation_config(header["metadata"])
    assert gen["max_denoising_steps"] == 48 and gen["t_max"] == 0.8 and gen["t_min"] == 0.4
    assert gen["eos_token_id"] == [1, 106, 50] and gen["mask_token_id"] == 4


def test_every_published_tensor_has_an_mlx_name(header):
    paths = [mlx_name(t["name"]) for t in header["tensors"]]
    assert None not in paths
    assert len(set(paths)) == len(paths)
    assert mlx_name("blk.0.unknown.weight") is None
    assert all("{i}" in v for k, v in NAME_MAP.items() if k.startswith("blk."))


def test_generation_overrides_from_gguf_keys():
    gen = generation_config({"diffusion.eb_max_steps": 16, "diffusion.eb_t_min": 0.3,
                             "diffusion.eb_entropy_bound": 0.2})
    assert gen["max_denoising_steps"] == 16 and gen["t_min"] == 0.3 and gen["entropy_bound"] == 0.2
    assert gen["t_max"] == 0.8
