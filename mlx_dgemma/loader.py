"""``load(path)``: a converted MLX directory, or a .gguf converted in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import ModelFilesError, NonFiniteError
from .model import DiffusionGemma, ModelArgs
from .precision import Precision, apply_precision, resolve_precision
from .quantized import quantize_modules
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
    for f in shards:
        weights.extend(mx.load(str(f)).items())
    _load_weights(model, weights, str(path))
    mx.eval(model.parameters())
    apply_precision(model, resolve_precision(precision))
    return model, config


def load_gguf(path: Path, precision: Precision | str = "exact", compact: bool = False,
              progress: Callable[[int, int, str], None] | None = None) -> tuple[DiffusionGemma, dict, dict]:
    """Convert a GGUF in memory (same repack as ``convert``); returns model, config, tokenizer data."""
    from .convert.converter import model_config, model_metadata, open_gguf, tokenizer_payload
    from .convert.metadata import generation_config
    from .convert.names import mlx_name
    from .convert.tensors import BF16Payload, convert_tensor

    reader = open_gguf(path)
    md, cfg = model_metadata(reader, str(path))
    specs: dict[str, dict] = {}
    weights: list[tuple[str, mx.array]] = []
    tensors = list(reader.tensors)
    for i, t in enumerate(tensors):
        try:
            c = convert_tensor(t, compact=compact)
        except NonFiniteError as e:  # name the file too
            raise NonFiniteError(f"{path}: {e}") from None
        for name, a in c.arrays.items():
            arr = mx.array(a.view(np.uint16)).view(mx.bfloat16) if isinstance(a, BF16Payload) else mx.array(a)
            weights.append((name, arr))
        if c.spec is not None:
            specs[mlx_name(t.name)[: -len(".weight")]] = c.spec.to_dict()
        if progress:
            progress(i + 1, len(tensors), t.name)
    config = model_config(md, cfg, specs, compact, str(path))
    model = build_model(config)
    _load_weights(model, weights, str(path))
    weights.clear()
    mx.eval(model.parameters())
    apply_precision(model, resolve_precision(precision))
    side = {"generation_config": generation_config(md), "tokenizer": tokenizer_payload(reader)}
    if "tokenizer.chat_template" in reader.fields:
        from .convert.metadata import field_value

        side["chat_template"] = str(field_value(reader, "tokenizer.chat_template"))
    return model, config, side


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
    from mlx_dgemma.api import load

    return load(model, precision=prec, progress=progress)
