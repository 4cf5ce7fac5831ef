"""Peers holding exactly a GGUF's weights: the Hugging Face reference (torch) and mlx-vlm's
MLX DiffusionGemma. Used by the benchmark and the parity tests (``tests/hf_reference.py``);
their packages (torch, transformers, mlx-vlm) are optional and imported only here, on demand.
Tooling, not runtime: nothing in the core imports this module.

Every tensor is dequantized with gguf-py into the Hugging Face checkpoint naming, into the
encoder and the decoder alike, except the layer scalars: ``enc_layer_output_scale`` goes
to the encoder's layers, ``layer_output_scale`` to the decoder's.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterator

import numpy as np

TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "num_hidden_layers": 1,
               "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}


def hf_names(path: str) -> tuple[str, ...]:
    """Our MLX parameter path -> Hugging Face checkpoint names (encoder and decoder copies)."""
    if path == "embed_tokens.weight":
        return ("model.encoder.language_model.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    if path == "norm.weight":
        return ("model.encoder.language_model.norm.weight", "model.decoder.norm.weight")
    if path.startswith("self_conditioning."):
        return ("model.decoder." + path,)
    if path == "rope_freqs":
        return ()
    if path.endswith(".encoder_layer_scalar"):
        return ("model.encoder.language_model." + path.replace("encoder_layer_scalar", "layer_scalar"),)
    if path.endswith(".layer_scalar"):
        return ("model.decoder." + path,)
    path = path.replace("experts.gate_up_proj.weight", "experts.gate_up_proj")
    path = path.replace("experts.down_proj.weight", "experts.down_proj")
    return ("model.encoder.language_model." + path, "model.decoder." + path)


def dequantized_tensors(gguf_path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(MLX path, float32 array in MLX/HF layout) for every tensor, one at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from mlx_dgemma.convert.names import mlx_name

    for t in GGUFReader(gguf_path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        yield mlx_name(t.name), dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def text_config(gguf_path: Path) -> tuple[dict, int]:
    """The GGUF's text config as the converter reads it (HF field names) and its canvas length."""
    from mlx_dgemma.convert import GGUFSource

    with GGUFSource(gguf_path) as src:
        text = src.args.to_dict()
        md = src.metadata
    text.pop("model_type", None)
    return text, int(md.get("diffusion.canvas_length", 256))


def hf_model_from_gguf(gguf_path: Path, attn_implementation: str = "eager", dtype: Any = None):
    """``DiffusionGemmaForBlockDiffusion`` holding the GGUF's dequantized weights."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text, canvas = text_config(gguf_path)
    # the config passes attn_implementation on to its sub-configs (text and vision)
    config = DiffusionGemmaConfig(text_config=text, vision_config=TINY_VISION, canvas_length=canvas,
                                  attn_implementation=attn_implementation)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).eval().to(dtype or torch.float32)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    seen = set()
    with torch.no_grad():
        for path, value in dequantized_tensors(gguf_path):
            for name in hf_names(path):
                target = params.get(name, buffers.get(name))
                if target is None:
                    raise KeyError(f"the HF model has no {name}")
                target.copy_(torch.from_numpy(np.array(value)).reshape(target.shape))  # a writable copy
                seen.add(name)
    missing = {n for n in params if "vision" not in n and n not in seen and n != "lm_head.weight"}
    if missing:
        raise KeyError(f"HF parameters not set from the GGUF: {sorted(missing)[:5]}")
    return model


class HFRunner:
    """Drives the HF model with a DynamicCache the way its generate() does, block by block."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        # transformers 5.24 renamed the cache argument (``past_key_values`` -> ``cache``; the old
        # name is deprecated): pass it under the name the installed version declares
        params = inspect.signature(model.model.encoder.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"

    def prefill(self, ids: np.ndarray) -> None:
        import torch

        with torch.no_grad():
            self.model.model.encoder(input_ids=torch.from_numpy(ids.astype(np.int64)),
                                     **{self._cache_name: self.cache})

    def denoise(self, canvas: np.ndarray, sc_logits: np.ndarray | None = None) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self.model(decoder_input_ids=torch.from_numpy(canvas.astype(np.int64)), **{self._cache_name: self.cache},
                             self_conditioning_logits=None if sc_logits is None else torch.from_numpy(sc_logits))
        return out.logits.float().numpy()


def mlx_vlm_model_from_gguf(gguf_path: Path, dtype: Any = None, quantize_bits: int | None = None,
                            group_size: int = 64):
    """mlx-vlm's DiffusionGemma with the GGUF's dequantized weights (dense in ``dtype``), or
    re-quantized by mlx-vlm's own predicate (its stock 4-bit, group 64) when ``quantize_bits``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.diffusion_gemma import Model, ModelConfig

    text, canvas = text_config(gguf_path)
    model = Model(ModelConfig.from_dict({"text_config": text, "canvas_length": canvas}))
    dtype = dtype or mx.float32
    weights = {}
    for path, value in dequantized_tensors(gguf_path):
        for name in hf_names(path):
            if name.startswith("model.encoder.language_model.") and not name.endswith("layer_scalar"):
                continue
            weights[name] = mx.array(value).astype(dtype)
    model.load_weights(list(model.sanitize(weights).items()), strict=False)
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits, class_predicate=model.quant_predicate)
    mx.eval(model.parameters())
    return model
