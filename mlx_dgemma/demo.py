"""The built-in demo model: a small random-weight DiffusionGemma, written once as a GGUF in
the user's cache and converted in memory. It shows the mechanics (canvas, steps, entropy),
not meaningful text; the UI labels it as random."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

DEMO_NAME = "demo-random-v1.gguf"
# Shown wherever the demo runs (CLI stderr, the chat app's banner): its output is not a model's.
DEMO_NOTICE = ("the built-in demo model has random weights: its text is noise, its denoising is real "
               "(README: Using a real model)")


def demo_spec():
    from .convert.synthetic import TinySpec

    return TinySpec(num_layers=4, global_layers=(3,), canvas_length=64, sliding_window=64, vocab_size=640)


def demo_path() -> Path:
    base = Path(os.environ.get("MLX_DGEMMA_CACHE", Path.home() / ".cache" / "mlx-dgemma"))
    return base / DEMO_NAME


def ensure_demo_gguf() -> Path:
    from .convert.synthetic import write_tiny_gguf

    path = demo_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        write_tiny_gguf(tmp, demo_spec(), types="q4_k_m", seed=1234)
        os.replace(tmp, path)
    return path


def load_demo(dtype: mx.Dtype | str | None = None, precision: str = "auto"):
    """(model, tokenizer) of the demo model; ``model.is_demo`` is True."""
    from .api import load

    model, tokenizer = load(ensure_demo_gguf(), precision=precision, dtype=dtype)
    object.__setattr__(model, "is_demo", True)
    return model, tokenizer
