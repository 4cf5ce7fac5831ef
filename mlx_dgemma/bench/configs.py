"""The benchmark's random models: named configs, each a synthetic Q4_K_M GGUF and its exact
conversion, cached in a work directory; and the random prompt and canvas every measurement
feeds them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

# The context length of every random model: a bench prompt and its canvas must fit in it.
CONTEXT = 65536

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=256, num_layers=3, global_layers=(2,), num_heads=2,
                 num_kv_heads=1, num_global_kv_heads=1, head_dim=64, global_head_dim=128, sliding_window=64,
                 num_experts=8, top_k=2, moe_intermediate_size=64, vocab_size=512, canvas_length=256),
    "medium": dict(hidden_size=512, intermediate_size=768, num_layers=6, global_layers=(5,), num_heads=8,
                   num_kv_heads=4, num_global_kv_heads=4, head_dim=64, global_head_dim=128,
                   sliding_window=512, num_experts=32, top_k=4, moe_intermediate_size=256, vocab_size=8192,
                   canvas_length=256),
    # The published model's layer shapes, one sliding and one global layer.
    "real-shapes": dict(hidden_size=2816, intermediate_size=2112, num_layers=2, global_layers=(1,), num_heads=16,
                        num_kv_heads=8, num_global_kv_heads=2, head_dim=256, global_head_dim=512,
                        sliding_window=1024, num_experts=128, top_k=8, moe_intermediate_size=704,
                        vocab_size=262144, canvas_length=256),
}


def _spec(name: str, canvas: int | None) -> dict[str, Any]:
    spec = dict(CONFIGS[name])
    if canvas is not None:  # 0 and negative values are refused by the bench's flag check
        spec["canvas_length"] = canvas
    return spec


def model_paths(name: str, workdir: Path, canvas: int | None) -> tuple[Path, Path]:
    """(GGUF, converted directory) of a config in ``workdir``: the files :func:`build` caches
    there and the bench reads (its ``--json`` may not be one of them)."""
    tag = f"{name}-c{_spec(name, canvas)['canvas_length']}"
    return workdir / f"{tag}.gguf", workdir / tag


def build(name: str, workdir: Path, canvas: int | None) -> tuple[Path, Path]:
    """Random Q4_K_M GGUF of a config and its exact conversion (cached in ``workdir``)."""
    # imported here: `mlx-dgemma --help` builds the bench's arguments without the converter
    from mlx_dgemma.convert.converter import convert
    from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf

    spec = _spec(name, canvas)
    gguf, out = model_paths(name, workdir, canvas)
    tag = out.name
    workdir.mkdir(parents=True, exist_ok=True)
    if not gguf.is_file():  # written aside and renamed: a failed or stopped write is never reused
        part = workdir / f".{tag}.gguf.part"
        try:
            write_tiny_gguf(part, TinySpec(**spec, context_length=CONTEXT), types="q4_k_m", seed=0,
                            weight_std=0.02)
            os.replace(part, gguf)
        finally:
            part.unlink(missing_ok=True)
    if not out.is_dir():
        convert(gguf, out)
    return gguf, out


def random_inputs(a: Any, canvas: int, prompt_len: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """A random prompt [1, prompt_len] and canvas [1, canvas] of token ids for model args ``a``."""
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(0, a.vocab_size, (1, prompt_len)), dtype=mx.int32)
    canv = mx.array(rng.integers(0, a.vocab_size, (1, canvas)), dtype=mx.int32)
    return prompt, canv
