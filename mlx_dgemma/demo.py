"""The built-in demo models.

* ``trained`` (the default): a tiny DiffusionGemma (9.9M parameters, 6 layers, 8 experts,
  64-token canvas) trained on the King James Bible by ``scripts/train_demo.py``. It ships
  inside the package as a GGUF in the published file's format (Q8_0), so the first run shows
  real words denoising, offline. It is not DiffusionGemma's weights.
* ``random``: random weights written once as a GGUF in the user's cache. Its text is noise;
  tests use its builder when they need arbitrary shapes.

This module knows the demo's files; :func:`mlx_dgemma.loader.load_demo` (also
``mlx_dgemma.load_demo``) loads them.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .errors import ModelFilesError, ParameterError

# Shown wherever the demo runs (CLI stderr, the chat app's banner): its output is not DiffusionGemma's.
DEMO_NOTICES = {
    "trained": ("the built-in demo is a tiny model (9.9M parameters) trained on the King James Bible, "
                "not DiffusionGemma's weights (README: Using a real model)"),
    "random": ("the random demo model has random weights: its text is noise, its denoising is real "
               "(README: Using a real model)"),
}

DEMO_NAME = "demo-random-v1.gguf"
TRAINED_NAME = "diffusiongemma-9.9M-kjv-demo-Q8_0.gguf"
DEMO_KINDS = ("trained", "random")

def demo_spec():
    """The random demo model's shape."""
    from .convert.synthetic import TinySpec

    return TinySpec(num_layers=4, global_layers=(3,), canvas_length=64, sliding_window=64, vocab_size=640)


def demo_path() -> Path:
    """Where the random demo GGUF is cached."""
    base = Path(os.environ.get("MLX_DGEMMA_CACHE", Path.home() / ".cache" / "mlx-dgemma"))
    return base / DEMO_NAME


def trained_demo_path() -> Path:
    """The trained demo GGUF shipped as package data."""
    return Path(str(resources.files("mlx_dgemma") / "data" / TRAINED_NAME))


def ensure_demo_gguf() -> Path:
    """The random demo GGUF, written on first use."""
    from .convert.synthetic import write_tiny_gguf

    path = demo_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        write_tiny_gguf(tmp, demo_spec(), types="q4_k_m", seed=1234)
        os.replace(tmp, path)
    return path


def demo_file(kind: str = "trained") -> Path:
    """The GGUF of the demo model ``kind`` ('trained' or 'random')."""
    if kind == "random":
        return ensure_demo_gguf()
    if kind != "trained":
        raise ParameterError(f"demo kind {kind!r}: expected one of {', '.join(DEMO_KINDS)}")
    path = trained_demo_path()
    if not path.is_file():
        raise ModelFilesError(f"{path}: the trained demo model is missing from the installed package; "
                              "reinstall mlx-dgemma (the wheel ships it), or use load_demo(kind='random')")
    return path
