"""What a converted model directory holds, described once for the converter and the runtime.

- :class:`ModelArgs`: the model's shape (``config.json``: ``text_config`` plus the canvas
  settings beside it). The converter fills it from GGUF metadata, the model is built from it.
- :class:`SamplerDefaults`: the reference sampler's defaults (``generation_config.json`` when
  the GGUF does not override them); ``mlx_dgemma.sampler.SamplerParams`` extends it.
- :class:`QuantSpec`: how one quantized weight is stored (``config.json``'s ``quantization``).
- :data:`SAFETENSORS_DTYPES` / :data:`STORED_DTYPES`: the weight files' dtype tags, and those
  a converted directory holds.
- :func:`pad_subblocks` / :func:`unpad_subblocks`: the padded sub-block layout of Q2_K, Q3_K
  and Q6_K, for NumPy arrays (the converter) and MLX arrays (the quantized layers) alike.

Plain data and NumPy only: no MLX import here, so the converter and tools can read it.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# config.json


@dataclass(kw_only=True)
class ModelArgs:
    """A DiffusionGemma model's shape: config.json's ``text_config`` (named as transformers
    names it) plus ``canvas_length`` and ``mask_token_id``, which config.json keeps beside it."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_global_key_value_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: list[str]
    sliding_window: int
    rope_parameters: dict[str, dict[str, Any]]
    rms_norm_eps: float = 1e-6
    vocab_size: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 262144
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 1
    model_type: str = "diffusion_gemma_text"
    # config.json top level, not text_config
    canvas_length: int = 256
    mask_token_id: int = 4
    # text_config keys this version does not know, kept so a config round-trips
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelArgs":
        """From a converted directory's config.json (``text_config`` plus canvas settings)."""
        tc = dict(config.get("text_config", config))
        names = {f.name for f in fields(cls)} - {"extra"}
        args = {k: tc[k] for k in names if k in tc}
        args["canvas_length"] = int(config.get("canvas_length", cls.canvas_length))
        args["mask_token_id"] = int(config.get("mask_token_id", cls.mask_token_id))
        return cls(**args, extra={k: v for k, v in tc.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        """config.json's ``text_config`` section (``canvas_length`` and ``mask_token_id`` are
        written beside it, not in it)."""
        d = asdict(self)
        for k in _TOP_LEVEL:
            del d[k]
        d.update(d.pop("extra"))
        return d

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"


_TOP_LEVEL = ("canvas_length", "mask_token_id")


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is stored (config.json ``quantization[module path]``): MLX affine
    parameters, plus the padded sub-block layout and the ggml type it came from."""

    bits: int
    group_size: int = 32
    scale_dtype: str = "float32"  # "float16" where that holds every scale exactly
    subblock: int = 32  # 32, or 16 for padded sub-blocks (Q2_K, Q3_K, Q6_K)
    ggml_type: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantSpec":
        """From config.json; keys left out take the defaults an MLX affine layer has."""
        return cls(bits=d["bits"], group_size=d.get("group_size", 32),
                   scale_dtype=d.get("scale_dtype", "float32"), subblock=d.get("subblock", 32),
                   ggml_type=d.get("ggml_type"))

    def to_dict(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "scale_dtype": self.scale_dtype,
                "subblock": self.subblock, "ggml_type": self.ggml_type}

    @property
    def padded(self) -> bool:
        """Stored rows are twice as wide: every 16-element sub-block padded to a 32-element group."""
        return self.subblock == 16


# ---------------------------------------------------------------------------------------------
# the runtime's memory shapes: declared here (no MLX) so the memory plan prices them where MLX is
# not imported (the converter's plan); the model, the cache and generation use them

# Prompt tokens per encoder pass. Measured on `medium` (benchmarks/prefill.py, RESULTS.md):
# throughput is flat from 256 to 1024 tokens and the working memory grows with the chunk.
DEFAULT_PREFILL_CHUNK = 512
# Upper bound on one attention call's float32 scores during prefill: longer contexts split
# the chunk's queries so the global layer's working memory stays flat as the cache grows.
ATTENTION_SCORES_BUDGET = 64 << 20
# Global layers' KV cache grows in buckets of this many positions.
DEFAULT_BUCKET = 1024


# ---------------------------------------------------------------------------------------------
# the weights' safetensors files

# a safetensors header's dtype tag -> the NumPy dtype of its bytes (bfloat16 as its raw uint16 payload,
# which the runtime views as bfloat16)
SAFETENSORS_DTYPES: dict[str, np.dtype] = {tag: np.dtype(t) for tag, t in (
    ("F64", np.float64), ("F32", np.float32), ("F16", np.float16), ("BF16", np.uint16), ("I64", np.int64),
    ("I32", np.int32), ("I16", np.int16), ("I8", np.int8), ("U64", np.uint64), ("U32", np.uint32),
    ("U16", np.uint16), ("U8", np.uint8), ("BOOL", np.bool_))}
# the tags a converted directory holds: the converter writes no others
STORED_DTYPES = ("F32", "F16", "BF16", "U32", "U8", "I32")


# ---------------------------------------------------------------------------------------------
# generation_config.json


@dataclass(frozen=True)
class SamplerDefaults:
    """The reference sampler's defaults (HF ``generation_diffusion_gemma.py``); a GGUF's
    ``diffusion.eb_*`` keys override them in generation_config.json. Then the answer guards'
    (``mlx_dgemma.guards``: not the reference's, which has none; 0 turns each off)."""

    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    max_new_tokens: int = 256
    eos_token_id: tuple[int, ...] = (1, 106, 50)
    pad_token_id: int = 0
    repetition_trim: int = 6  # TensorSharp's: a token recurring at stride 1-2 six times
    duplicate_drop: int = 1  # llama.cpp's: an answer that is one text twice (each copy >= 1 character)
    # measured on the trained demo (benchmarks/guards.py commit; README "Answer guards"): converged
    # blocks end below 0.005, blocks cut at 6 steps below 0.017, 1-3 steps leave 0.03-0.31
    commit_entropy: float = 0.05
    empty_rerolls: int = 2  # as the port that re-rolls an empty first canvas twice (256 -> 128 -> 64)


def generation_defaults() -> dict[str, Any]:
    """:class:`SamplerDefaults` as generation_config.json writes them (lists, not tuples)."""
    return {f.name: list(v) if isinstance(v := getattr(SamplerDefaults, f.name), tuple) else v
            for f in fields(SamplerDefaults)}


# ---------------------------------------------------------------------------------------------
# padded sub-blocks


def _array_module(a: Any) -> Any:
    """NumPy, or MLX for an MLX array (then already imported: nothing is imported here)."""
    return sys.modules["mlx.core"] if type(a).__module__.split(".")[0] == "mlx" else np


def pad_subblocks(x: Any, subblock: int) -> Any:
    """[..., n] -> [..., 2n]: each ``subblock`` run followed by as many zeros (NumPy or MLX).

    The stored form of a 16-element sub-block type, and the input its padded weights
    multiply: the zeros meet the padding, so the product is the original weight's."""
    if subblock == 32:
        return x
    xp = _array_module(x)
    *lead, n = x.shape
    x = x.reshape(*lead, n // subblock, 1, subblock)  # [..., n/16, 1, 16]
    x = xp.concatenate([x, xp.zeros_like(x)], axis=-2)  # [..., n/16, 2, 16]
    return x.reshape(*lead, 2 * n)


def unpad_subblocks(w: Any, subblock: int) -> Any:
    """Inverse of :func:`pad_subblocks` along the last axis: [..., 2n] -> [..., n] (NumPy or MLX)."""
    if subblock == 32:
        return w
    *lead, n = w.shape
    return w.reshape(*lead, n // (2 * subblock), 2, subblock)[..., 0, :].reshape(*lead, n // 2)
