"""``load``: the one entry point that turns a path into (model, tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import json

import mlx.core as mx

from .errors import ModelFilesError
from .model import DiffusionGemma
from .paths import user_path
from .precision import Precision, resolve_precision
from .tokenizer import Tokenizer


def load(path: str | Path, precision: str | Precision = "auto", dtype: str | mx.Dtype | None = None,
         compact: bool = False,
         progress: Callable[[int, int, str], None] | None = None) -> tuple[DiffusionGemma, Tokenizer]:
    """Load a converted directory, or convert a .gguf in memory (exact unless ``compact``).

    ``precision`` is the runtime precision (``mlx_dgemma.precision``): "exact" (float32,
    bit-exact weights), "fast" (the device's fast activation dtype, scales cast to it, padded
    sub-block tensors re-quantized to 8 bits) or "auto" (= fast). ``dtype`` picks fast's
    activation dtype (default: bfloat16 on a GPU, float32 on the CPU). Nothing on disk changes.
    ``~`` and environment variables in ``path`` are expanded.
    The model's generation defaults (generation_config.json or the GGUF's) are attached as
    ``model.generation_config``; the resolved precision as ``model.precision``.
    """
    from .loader import load_dir, load_gguf

    prec = resolve_precision(precision, dtype)
    p = user_path(path)  # "~/models/dgemma" works as README writes it
    if p.is_dir():
        model, _ = load_dir(p, precision=prec)
        tokenizer = Tokenizer.from_dir(p)
        gen_file = p / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    elif p.is_file():
        model, _, side = load_gguf(p, precision=prec, compact=compact, progress=progress)
        tokenizer = Tokenizer(side["tokenizer"], side.get("chat_template"))
        gen = side["generation_config"]
    else:
        raise ModelFilesError(f"{p}: no such file or directory; give a .gguf file or a directory written "
                              "by `mlx-dgemma convert`")
    object.__setattr__(model, "generation_config", gen)  # a plain attribute, not a parameter
    return model, tokenizer
