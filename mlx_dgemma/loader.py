"""``load(path)``, the one entry point from a path to (model, tokenizer): a converted MLX
directory, or a .gguf converted in memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .distributed import load_sharded_weights, world
from .errors import ModelFilesError
from .model import DiffusionGemma, ModelArgs
from .paths import user_path
from .precision import Precision, apply_precision, resolve_precision
from .quantized import quantize_modules
from .schema import QuantSpec
from .tokenizer import Tokenizer
from .validate import check_model_dir, model_dir_shards

REQUIRED_FILES = ("config.json", "tokenizer_gguf.json")  # checked by validate.check_model_dir


def build_model(config: dict[str, Any]) -> DiffusionGemma:
    """An (unloaded) model whose modules match the config's quantization section."""
    model = DiffusionGemma(ModelArgs.from_config(config))
    quantize_modules(model, config.get("quantization", {}))
    return model


def _load_weights(model: nn.Module, weights: list[tuple[str, mx.array]], source: str) -> None:
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise ModelFilesError(f"{source}: weights do not match config.json ({e}); convert the model again") from e


def load_dir(path: Path, precision: Precision | str = "exact") -> tuple[DiffusionGemma, dict]:
    """A converted directory, loaded exactly and then put in ``precision``'s runtime form."""
    config = check_model_dir(path)  # every file's keys, types, ranges and headers, before any work
    shards = model_dir_shards(path)
    try:
        model = build_model(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFilesError(f"{path / 'config.json'}: does not describe a buildable model ({e}); convert "
                              "the model again") from e
    weights: list[tuple[str, mx.array]] = []
    group = world()  # several ranks (mlx.launch): shard, and read only this rank's slices of the files
    if group is not None:
        weights = load_sharded_weights(model, shards, group)
    else:
        for f in shards:
            weights.extend(mx.load(str(f)).items())
    _load_weights(model, weights, str(path))
    mx.eval(model.parameters())
    apply_precision(model, resolve_precision(precision))
    return model, config


def load_gguf(path: Path, precision: Precision | str = "exact", compact: bool = False,
              progress: Callable[[int, int, str], None] | None = None) -> tuple[DiffusionGemma, dict, dict]:
    """Convert a GGUF in memory (same repack as ``convert``); returns model, config and the side
    data (``generation_config``, ``tokenizer``, and ``chat_template`` when the GGUF has one)."""
    from mlx_dgemma.convert import BF16Payload, GGUFSource

    def report(done: int, total: int, i: int, n: int, name: str) -> None:
        progress(i, n, name)

    weights: list[tuple[str, mx.array]] = []
    specs: dict[str, QuantSpec] = {}
    with GGUFSource(path) as source:
        for c in source.tensors(compact=compact, progress=report if progress else None):
            for name, a in c.arrays.items():
                arr = mx.array(a.view(np.uint16)).view(mx.bfloat16) if isinstance(a, BF16Payload) else mx.array(a)
                weights.append((name, arr))
            if c.spec is not None:
                specs[c.module] = c.spec
        config = source.config(specs, compact)
        model = build_model(config)
        _load_weights(model, weights, str(path))
        weights.clear()
        if (group := world()) is not None:  # several ranks: each converted the whole GGUF, keeps its slices
            model.shard(group)
        mx.eval(model.parameters())
        apply_precision(model, resolve_precision(precision))
        side = {"generation_config": source.generation_config, "tokenizer": source.tokenizer}
        if source.chat_template is not None:
            side["chat_template"] = source.chat_template
    return model, config, side


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


# --------------------------------------------------------------------------------------------
# The one loader of the front ends (CLI, chat app, server): --model or --demo, --precision and
# --dtype, with the same checks and errors everywhere. Imports are lazy (nothing above is used).


def check_model_choice(model: str | None, demo: bool) -> None:
    """``--demo`` and ``--model`` name two different models: refuse rather than silently pick one."""
    from mlx_dgemma.errors import ParameterError

    if demo and model:
        raise ParameterError(f"--demo and --model {model}: give one of them (--demo runs the built-in "
                             "demo model; --model runs yours)")


def open_model(model: str | None, demo: bool, precision: str = "auto", dtype: str | None = None,
               progress: Callable[[int, int, str], None] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for a front end: the built-in demo model if ``demo``, else ``model``
    (a converted directory or a .gguf, ``~`` expanded), in runtime ``precision`` (``dtype``:
    fast's activation dtype). ``progress(i, n, tensor)`` follows a .gguf's in-memory conversion.

    A contradictory precision, both or neither model are errors before any loading.
    """
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.precision import resolve_precision

    prec = resolve_precision(precision, dtype)
    check_model_choice(model, demo)
    if demo:
        from mlx_dgemma.demo import load_demo

        return load_demo(precision=prec)
    if not model:
        raise ParameterError("--model: not given; pass a converted directory or a .gguf file "
                             "(or --demo for the built-in demo model)")
    return load(model, precision=prec, progress=progress)
