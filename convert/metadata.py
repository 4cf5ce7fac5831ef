"""GGUF metadata: what a DiffusionGemma GGUF's keys must hold (types, ranges, cross-field rules),
and the model's shape (``mlx_dgemma.schema.ModelArgs``) and generation defaults read from them."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_dgemma.errors import ModelFilesError, NonFiniteError, ParameterError
from mlx_dgemma.params import check_generation_field, gguf_keys
from mlx_dgemma.schema import ModelArgs, generation_defaults
from mlx_dgemma.validate import (KIND_TEXT, TOKEN_ID_KEYS, TOKENIZER_MODELS, check_chat_template, kind_ok,
                                 short_repr)

from .errors import ConvertError
from .header import GGUFHeader

ARCH = "diffusion-gemma"

# Arrays longer than this are tokenizer payloads; they are read separately.
_SMALL_ARRAY = 4096


def field_value(header: GGUFHeader, key: str, full: bool = False) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list); an array longer than
    the tokenizer-payload bound is summarized unless ``full``."""
    kind, _, count = header.kinds[key]
    if kind == "array" and not full and count > _SMALL_ARRAY:
        return f"<array of {count}>"
    return header.value(key)


def read_metadata(header: GGUFHeader) -> dict[str, Any]:
    """All metadata keys except GGUF bookkeeping; long arrays are summarized."""
    return {k: field_value(header, k) for k in header.keys() if not k.startswith("GGUF.")}


def field_kinds(header: GGUFHeader) -> dict[str, tuple[str, str | None, int]]:
    """key -> (value type, array item type or None, item count), for validation."""
    return dict(header.kinds)


# ---------------------------------------------------------------------------------------------
# What a DiffusionGemma GGUF's metadata must hold, checked before anything is built from it

_P = ARCH + "."
# key: (kind, low, high, required); kinds: int, float, bool, str, int|list
_GGUF_KEYS: dict[str, tuple[str, float, float, bool]] = {
    _P + "block_count": ("int", 1, 512, True),
    _P + "context_length": ("int", 1, 1 << 24, True),
    _P + "embedding_length": ("int", 1, 1 << 20, True),
    _P + "feed_forward_length": ("int", 1, 1 << 22, True),
    _P + "attention.head_count": ("int", 1, 1024, True),
    _P + "attention.head_count_kv": ("int|list", 1, 1024, True),
    _P + "attention.key_length": ("int", 1, 4096, True),
    _P + "attention.key_length_swa": ("int", 1, 4096, True),
    _P + "attention.sliding_window": ("int", 1, 1 << 24, True),
    _P + "attention.sliding_window_pattern": ("list", 0, 0, True),
    _P + "rope.freq_base": ("float", 1e-6, 1e30, True),
    _P + "rope.freq_base_swa": ("float", 1e-6, 1e30, True),
    _P + "attention.layer_norm_rms_epsilon": ("float", 1e-30, 1.0, True),
    _P + "expert_count": ("int", 1, 4096, True),
    _P + "expert_used_count": ("int", 1, 4096, True),
    _P + "expert_feed_forward_length": ("int", 1, 1 << 22, True),
    _P + "final_logit_softcapping": ("float", 1e-6, 1e6, False),
    "diffusion.canvas_length": ("int", 1, 1 << 16, False),
    "general.name": ("str", 0, 0, False),
    "tokenizer.ggml.model": ("str", 0, 0, False),
    "tokenizer.chat_template": ("str", 0, 0, False),
}


def check_gguf_metadata(md: dict[str, Any], kinds: dict[str, tuple[str, str | None, int]], source: str) -> int:
    """Types, ranges and cross-field consistency of a DiffusionGemma GGUF's metadata. ``kinds``
    (:func:`field_kinds`) covers the long tokenizer arrays that ``md`` only summarizes.
    Returns the vocabulary size."""
    def bad(key: str, rule: str) -> None:
        raise ModelFilesError(f"{source}: {key} = {short_repr(md.get(key))}: expected {rule}; the file is not a "
                              "valid DiffusionGemma GGUF")

    for key, (kind, low, high, required) in _GGUF_KEYS.items():
        if key not in md:
            if required:
                raise ModelFilesError(f"{source}: metadata key {key!r} is missing; the file is not a complete "
                                      "DiffusionGemma GGUF")
            continue
        v = md[key]
        if not kind_ok(kind, v):
            bad(key, KIND_TEXT[kind])
        if kind in ("int", "float") and not low <= v <= high:
            bad(key, f"a value in [{low:g}, {high:g}]")
        if kind == "int|list" and any(not low <= x <= high for x in (v if isinstance(v, list) else [v])):
            bad(key, f"values in [{low:g}, {high:g}]")
    n_layers = md[_P + "block_count"]
    pattern = md[_P + "attention.sliding_window_pattern"]
    if len(pattern) != n_layers or not all(isinstance(x, bool) for x in pattern):
        bad(_P + "attention.sliding_window_pattern", f"{n_layers} booleans (one per layer)")
    kv = md[_P + "attention.head_count_kv"]
    if isinstance(kv, list) and len(kv) != n_layers:
        bad(_P + "attention.head_count_kv", f"{n_layers} integers (one per layer)")
    heads = md[_P + "attention.head_count"]
    for x in kv if isinstance(kv, list) else [kv]:
        if heads % x:
            bad(_P + "attention.head_count_kv", f"divisors of attention.head_count = {heads}")
    if md[_P + "expert_used_count"] > md[_P + "expert_count"]:
        bad(_P + "expert_used_count", f"at most expert_count = {md[_P + 'expert_count']}")
    ctx, canvas = md[_P + "context_length"], md.get("diffusion.canvas_length", ModelArgs.canvas_length)
    if canvas >= ctx:  # a block needs the canvas and at least one prompt token in the context
        shown = "" if "diffusion.canvas_length" in md else " (absent: the default)"
        raise ModelFilesError(f"{source}: diffusion.canvas_length = {canvas}{shown}: expected at most {ctx - 1}, "
                              f"below {_P}context_length = {ctx} (a canvas and its prompt must fit in the "
                              "context); the file is not a valid DiffusionGemma GGUF")
    for key, param in gguf_keys().items():  # diffusion.eb_*: sampler defaults
        if key in md:
            try:
                check_generation_field(param.name, md[key])
            except ParameterError as e:
                bad(key, e.rule or "a valid value")
    # tokenizer: arrays checked by type and length (md only summarizes long ones)
    tokens = kinds.get("tokenizer.ggml.tokens")
    if tokens is None:
        vocab = None
    else:
        if tokens[0] != "array" or tokens[1] != "string" or tokens[2] < 1:
            raise ModelFilesError(f"{source}: tokenizer.ggml.tokens: expected a non-empty array of strings; "
                                  "the file has no usable vocabulary")
        vocab = tokens[2]
        if vocab > 1 << 22:
            raise ModelFilesError(f"{source}: tokenizer.ggml.tokens has {vocab} entries (at most {1 << 22})")
        for key, item in (("tokenizer.ggml.scores", "float32"), ("tokenizer.ggml.token_type", "int32")):
            k = kinds.get(key)
            if k is not None and (k[0] != "array" or k[2] != vocab or k[1] not in (item, "uint32", "int32", "float32")):
                got = f"{k[2]} {k[1]}" if k[0] == "array" else f"a {k[0]}"
                raise ModelFilesError(f"{source}: {key}: expected an array of {vocab} numbers (one per token; "
                                      f"float32, int32 or uint32), got {got}")
        k = kinds.get("tokenizer.ggml.merges")
        if k is not None and (k[0] != "array" or k[1] != "string"):
            raise ModelFilesError(f"{source}: tokenizer.ggml.merges: expected an array of strings 'a b'")
        model = md.get("tokenizer.ggml.model", "gemma4")
        if model not in TOKENIZER_MODELS:
            bad("tokenizer.ggml.model", " or ".join(map(repr, TOKENIZER_MODELS)))
        for key in TOKEN_ID_KEYS:
            if key in md and not (kind_ok("int", md[key]) and 0 <= md[key] < vocab):
                bad(key, f"a token id in [0, {vocab})")
    if "tokenizer.chat_template" in md:
        check_chat_template(md["tokenizer.chat_template"], f"{source}: tokenizer.chat_template")
    return vocab


def array_len(header: GGUFHeader, key: str) -> int | None:
    """Items in ``key``'s value (1 for a scalar), None if the file has no such key."""
    kind = header.kinds.get(key)
    return None if kind is None else kind[2]


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
        final_logit_softcapping=float(get("final_logit_softcapping", ModelArgs.final_logit_softcapping)),
        max_position_embeddings=int(get("context_length")),
        pad_token_id=int(md.get("tokenizer.ggml.padding_token_id", 0)),
        bos_token_id=int(md.get("tokenizer.ggml.bos_token_id", ModelArgs.bos_token_id)),
        eos_token_id=int(md.get("tokenizer.ggml.eos_token_id", 1)),
        canvas_length=int(md.get("diffusion.canvas_length", ModelArgs.canvas_length)),
        mask_token_id=int(md.get("tokenizer.ggml.mask_token_id", ModelArgs.mask_token_id)),
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
    cfg["bos_token_id"] = int(md.get("tokenizer.ggml.bos_token_id", ModelArgs.bos_token_id))
    cfg["mask_token_id"] = int(md.get("tokenizer.ggml.mask_token_id", ModelArgs.mask_token_id))
    return cfg
