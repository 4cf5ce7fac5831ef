"""GGUF metadata -> the model's shape (``mlx_dgemma.schema.ModelArgs``) and generation defaults."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from mlx_dgemma.errors import NonFiniteError
from mlx_dgemma.params import gguf_keys
from mlx_dgemma.schema import ModelArgs, generation_defaults

from .errors import ConvertError

ARCH = "diffusion-gemma"

# Arrays longer than this are tokenizer payloads; they are read separately.
_SMALL_ARRAY = 4096


def field_value(reader: GGUFReader, key: str, full: bool = False) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list)."""
    f = reader.fields[key]
    if f.types[0] == GGUFValueType.ARRAY:
        if not full and len(f.data) > _SMALL_ARRAY:
            return f"<array of {len(f.data)}>"
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
        if not f.data:
            return []
        return np.concatenate([f.parts[i] for i in f.data]).tolist()  # one pass, not per item
    return f.contents()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata keys except GGUF bookkeeping; long arrays are summarized."""
    return {k: field_value(reader, k) for k in reader.fields if not k.startswith("GGUF.")}


_TYPE_NAMES = {GGUFValueType.UINT8: "uint8", GGUFValueType.INT8: "int8", GGUFValueType.UINT16: "uint16",
               GGUFValueType.INT16: "int16", GGUFValueType.UINT32: "uint32", GGUFValueType.INT32: "int32",
               GGUFValueType.FLOAT32: "float32", GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "string",
               GGUFValueType.UINT64: "uint64", GGUFValueType.INT64: "int64", GGUFValueType.FLOAT64: "float64"}


def field_kinds(reader: GGUFReader) -> dict[str, tuple[str, str | None, int]]:
    """key -> (value type, array item type or None, item count), for validation."""
    out = {}
    for k, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            item = _TYPE_NAMES.get(f.types[-1], "array") if len(f.types) > 1 else "uint8"
            out[k] = ("array", item, len(f.data))
        elif f.types:
            out[k] = (_TYPE_NAMES.get(f.types[0], "unknown"), None, 1)
    return out


def array_len(reader: GGUFReader, key: str) -> int | None:
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def args_from_metadata(md: dict[str, Any], vocab_size: int, source: str = "GGUF",
                       partial_rotary_factor: float = 0.25) -> ModelArgs:
    """The model's shape from GGUF metadata (keys as in the published header)."""
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise ConvertError(f"{source}: general.architecture is {arch!r}, expected {ARCH!r}; "
                           "this tool converts DiffusionGemma GGUF files only")

    def get(key: str, default: Any = None) -> Any:
        full = f"{ARCH}.{key}"
        if full in md:
            return md[full]
        if default is None:
            raise ConvertError(f"{source}: metadata key {full!r} is missing; "
                               "the file is not a complete DiffusionGemma GGUF")
        return default

    n_layers = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise ConvertError(f"{source}: {ARCH}.attention.sliding_window_pattern must list "
                           f"{n_layers} booleans (one per layer)")
    kv = get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n_layers
    layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
    sliding_kv = {k for k, s in zip(kv, pattern) if s}
    global_kv = {k for k, s in zip(kv, pattern) if not s}
    if len(sliding_kv) > 1 or len(global_kv) > 1:
        raise ConvertError(f"{source}: {ARCH}.attention.head_count_kv varies within a layer "
                           f"type ({kv}); expected one value for sliding and one for global layers")
    n_kv = sliding_kv.pop() if sliding_kv else global_kv.copy().pop()
    n_kv_global = global_kv.pop() if global_kv else n_kv
    return ModelArgs(
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(n_kv),
        num_global_key_value_heads=int(n_kv_global),
        head_dim=int(get("attention.key_length_swa")),
        global_head_dim=int(get("attention.key_length")),
        layer_types=layer_types,
        sliding_window=int(get("attention.sliding_window")),
        rope_parameters={
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(get("rope.freq_base_swa"))},
            "full_attention": {"rope_type": "proportional",
                               "partial_rotary_factor": partial_rotary_factor,
                               "rope_theta": float(get("rope.freq_base"))},
        },
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab_size),
        num_experts=int(get("expert_count")),
        top_k_experts=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
        max_position_embeddings=int(get("context_length")),
        pad_token_id=int(md.get("tokenizer.ggml.padding_token_id", 0)),
        bos_token_id=int(md.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=int(md.get("tokenizer.ggml.eos_token_id", 1)),
        canvas_length=int(md.get("diffusion.canvas_length", 256)),
        mask_token_id=int(md.get("tokenizer.ggml.mask_token_id", 4)),
    )


def partial_rotary_factor(rope_freqs: np.ndarray, source: str) -> float:
    """Fraction of rotated dimensions from llama.cpp's ``rope_freqs`` (1 = rotate, huge = keep).

    transformers' "proportional" RoPE rotates the first ``factor * head_dim / 2`` frequency
    pairs and leaves the rest unrotated; llama.cpp encodes the same with factors 1 and 1e30.
    """
    f = np.asarray(rope_freqs, dtype=np.float32)
    finite = np.isfinite(f)
    if not finite.all():  # a corrupt file, not a RoPE variant (as for every other weight)
        raise NonFiniteError(f"{source}: tensor 'rope_freqs.weight': {f.size - int(finite.sum())} of {f.size} "
                             "values are NaN or Inf; the file is corrupt, download it again")
    rotated = int(np.count_nonzero(f == 1.0))
    if not (np.all(f[:rotated] == 1.0) and np.all(f[rotated:] >= 1e20)):
        raise ConvertError(f"{source}: rope_freqs.weight must be 1.0 for a prefix and >= 1e20 after "
                           "it (proportional RoPE); other frequency factors are not supported")
    return rotated / f.size


def _shortest(v: Any) -> float:
    """A float32 GGUF value as the decimal its writer meant (0.05, not 0.05000000074505806): the
    shortest decimal that rounds to the same float32, so the sampler's float32 arithmetic is
    unchanged and settings and JSON show what the file says. Wider values are kept as they are."""
    v = float(v)
    f32 = np.float32(v)
    return float(str(f32)) if np.isfinite(f32) and float(f32) == v else v


def generation_config(md: dict[str, Any]) -> dict[str, Any]:
    """Sampler defaults, overridden by the GGUF's optional ``diffusion.eb_*`` keys."""
    cfg = generation_defaults()
    for key, param in gguf_keys().items():  # the GGUF keys overriding them (mlx_dgemma.params)
        if key in md:
            cfg[param.name] = _shortest(md[key]) if param.kind is float else param.kind(md[key])
    cfg["bos_token_id"] = int(md.get("tokenizer.ggml.bos_token_id", 2))
    cfg["mask_token_id"] = int(md.get("tokenizer.ggml.mask_token_id", 4))
    return cfg
