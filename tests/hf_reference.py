"""The Hugging Face reference (transformers >= 5.23) holding exactly our GGUF's weights.

Every tensor is dequantized with gguf-py and copied into ``DiffusionGemmaForBlockDiffusion``,
into the encoder and the decoder alike, except the layer scalars: ``enc_layer_output_scale``
goes to the encoder's layers, ``layer_output_scale`` to the decoder's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", minversion="5.23",
                                   reason="parity needs transformers >= 5.23 (DiffusionGemma)")

from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

from mlx_dgemma.convert.converter import model_metadata  # noqa: E402
from mlx_dgemma.convert.names import mlx_name  # noqa: E402

TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "num_hidden_layers": 1,
               "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}


def _hf_name(path: str) -> tuple[str, ...]:
    """Our MLX parameter path -> HF names (encoder and decoder copies)."""
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


def hf_model_from_gguf(gguf_path: Path, attn_implementation: str = "eager") -> DiffusionGemmaForBlockDiffusion:
    reader = GGUFReader(gguf_path)
    md, cfg = model_metadata(reader, str(gguf_path))
    text = cfg.to_dict()
    text.pop("model_type", None)
    config = DiffusionGemmaConfig(text_config=text, vision_config=TINY_VISION,
                                  canvas_length=int(md["diffusion.canvas_length"]))
    config.text_config._attn_implementation = attn_implementation
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).eval().float()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    seen = set()
    with torch.no_grad():
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape))
            value = torch.from_numpy(np.ascontiguousarray(
                dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)))
            for name in _hf_name(mlx_name(t.name)):
                target = params.get(name, buffers.get(name))
                assert target is not None, f"HF model has no {name}"
                target.copy_(value.reshape(target.shape))
                seen.add(name)
    missing = {n for n in params if "vision" not in n and n not in seen and n != "lm_head.weight"}
    assert not missing, f"HF parameters not set from the GGUF: {sorted(missing)[:5]}"
    assert torch.equal(model.lm_head.weight, params["model.decoder.embed_tokens.weight"])
    return model


class HFRunner:
    """Drives the HF model with a DynamicCache the way generate() does, block by block."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> None:
        self.model.model.encoder(input_ids=torch.from_numpy(ids.astype(np.int64)), past_key_values=self.cache)

    @torch.no_grad()
    def denoise(self, canvas: np.ndarray, sc_logits: np.ndarray | None = None) -> np.ndarray:
        out = self.model(decoder_input_ids=torch.from_numpy(canvas.astype(np.int64)), past_key_values=self.cache,
                         self_conditioning_logits=None if sc_logits is None else torch.from_numpy(sc_logits))
        return out.logits.float().numpy()
