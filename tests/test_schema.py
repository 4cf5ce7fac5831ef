"""mlx_dgemma.schema: the one description of what a converted directory holds, read by the
converter (NumPy) and the runtime (MLX) alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma.convert.metadata import generation_config
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.schema import ModelArgs, QuantSpec, pad_subblocks, unpad_subblocks

ROOT = Path(__file__).resolve().parents[1]


def test_schema_imports_no_mlx():
    # the converter and tools read the schema without MLX
    code = ("import sys, mlx_dgemma.schema; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'); "
            "assert not bad, f'MLX imported: {bad}'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_model_args_round_trip_a_converted_config(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    args = ModelArgs.from_config(config)
    assert args.to_dict() == config["text_config"]  # what the converter wrote, key for key
    assert (args.canvas_length, args.mask_token_id) == (config["canvas_length"], config["mask_token_id"])
    assert args.extra == {}


def test_model_args_keep_unknown_keys_and_take_canvas_settings_from_the_top_level(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["text_config"]["future_key"] = [1, 2]
    config["text_config"]["canvas_length"] = 999  # the top-level value wins, as before
    config["canvas_length"] = 64
    args = ModelArgs.from_config(config)
    assert args.extra == {"future_key": [1, 2]} and args.canvas_length == 64
    assert args.to_dict()["future_key"] == [1, 2] and "canvas_length" not in args.to_dict()


def test_quant_spec_dict_round_trip_and_defaults(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    specs = {k: v for k, v in config["quantization"].items() if isinstance(v, dict)}
    assert specs and any(v["subblock"] == 16 for v in specs.values())
    for v in specs.values():
        assert QuantSpec.from_dict(v).to_dict() == v
    bare = QuantSpec.from_dict({"bits": 4})  # a hand-written config: MLX affine defaults
    assert (bare.bits, bare.group_size, bare.subblock, bare.padded) == (4, 32, 32, False)
    assert QuantSpec.from_dict({"bits": 6, "subblock": 16}).padded


def test_the_converters_generation_defaults_are_the_samplers():
    # a GGUF without diffusion.eb_* keys samples with exactly SamplerParams' defaults
    assert SamplerParams.from_config(generation_config({})) == SamplerParams()


@pytest.mark.parametrize("subblock", [16, 32])
def test_padding_is_the_same_for_numpy_and_mlx(subblock):
    x = np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32)
    p_np = pad_subblocks(x, subblock)
    p_mx = pad_subblocks(mx.array(x), subblock)
    assert isinstance(p_np, np.ndarray) and isinstance(p_mx, mx.array)
    assert np.array_equal(np.array(p_mx), p_np)
    assert p_np.shape == (3, 2, 128 if subblock == 16 else 64)
    if subblock == 16:
        assert np.all(p_np.reshape(3, 2, 4, 2, 16)[..., 1, :] == 0)  # zeros after every sub-block
    assert np.array_equal(unpad_subblocks(p_np, subblock), x)
    assert np.array_equal(np.array(unpad_subblocks(p_mx, subblock)), x)


def test_float32_sampler_keys_read_as_written():
    """A GGUF stores diffusion.eb_t_min = 0.05 as float32; the settings dialog and JSON should
    show 0.05 (not 0.05000000074505806) while the sampler's float32 value stays the same."""
    import numpy as np

    from mlx_dgemma.convert.metadata import generation_config

    stored = {"diffusion.eb_t_min": float(np.float32(0.05)), "diffusion.eb_t_max": float(np.float32(0.3)),
              "diffusion.eb_entropy_bound": 1 / 3}  # the last one not a float32 value: kept as is
    cfg = generation_config(stored)
    assert (cfg["t_min"], cfg["t_max"], cfg["entropy_bound"]) == (0.05, 0.3, 1 / 3)
    assert np.float32(cfg["t_min"]) == np.float32(stored["diffusion.eb_t_min"])
