"""GGUF metadata: what a DiffusionGemma GGUF's keys must hold, and the model's shape
(``mlx_dgemma.schema.ModelArgs``) and generation defaults read from them. The keys, kinds,
ranges and rules of the model's fields are declared on ModelArgs itself (``ArgSpec``): this
module reads and checks by them, naming each fault by its GGUF key."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_dgemma.errors import ModelArgsError, ModelFilesError, NonFiniteError, ParameterError
from mlx_dgemma.params import check_generation_field, gguf_keys
from mlx_dgemma.schema import (GGUF_ARCH, KIND_TEXT, LAYER_TYPES, ArgSpec, ModelArgs, arg_specs, generation_defaults,
                               kind_ok)
from mlx_dgemma.validate import TOKEN_ID_KEYS, TOKENIZER_MODELS, check_chat_template, short_repr

from .errors import ConvertError
from .header import GGUFHeader

ARCH = GGUF_ARCH

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
# What a DiffusionGemma GGUF's metadata must hold, checked before anything is built from it: the
# keys of ModelArgs' fields (their ArgSpecs in mlx_dgemma.schema) and these others

_OTHER_KEYS = ("general.name", "tokenizer.ggml.model", "tokenizer.chat_template")  # strings, optional
# how a key holding a field is typed, by how the field is read from it (ArgSpec.read)
_STORED_KIND = {"sliding": "int|list", "global": "int|list", "pattern": "list", "rope": "float"}


def _key_specs() -> dict[str, tuple[str, ArgSpec]]:
    """GGUF key -> (its kind as stored, the spec of the field read from it), for every field read
    from a key (a field's array length, ``count``, is the tokenizer check's)."""
    out: dict[str, tuple[str, ArgSpec]] = {}
    for spec in arg_specs().values():
        if spec.read != "count":
            out.update((key, (_STORED_KIND.get(spec.read, spec.kind), spec)) for key in spec.keys)
    return out


def _gguf_bad(source: str, key: str, value: Any, rule: str) -> ModelFilesError:
    return ModelFilesError(f"{source}: {key} = {short_repr(value)}: expected {rule}; the file is not a valid "
                           "DiffusionGemma GGUF")


def check_gguf_metadata(md: dict[str, Any], kinds: dict[str, tuple[str, str | None, int]], source: str) -> int:
    """Types and ranges of a DiffusionGemma GGUF's metadata (the rules between the model's fields:
    :func:`check_args`, once they are read). ``kinds`` (:func:`field_kinds`) covers the long
    tokenizer arrays that ``md`` only summarizes. Returns the vocabulary size."""
    def bad(key: str, rule: str) -> None:
        raise _gguf_bad(source, key, md.get(key), rule)

    for key, (kind, spec) in _key_specs().items():
        if key not in md:
            if spec.required:
                raise ModelFilesError(f"{source}: metadata key {key!r} is missing; the file is not a complete "
                                      "DiffusionGemma GGUF")
            continue
        v = md[key]
        if kind == "int|list":  # one value, or one per layer
            if not kind_ok(kind, v) or not all(spec.ok(x) for x in (v if isinstance(v, list) else [v])):
                bad(key, f"{spec.rule}, or an array of them (one per layer)")
        elif kind == "list":  # its items and length: read_args
            if not kind_ok(kind, v):
                bad(key, KIND_TEXT[kind])
        elif spec.kind == "rope":  # one rope_theta
            if not spec.in_range(v):
                bad(key, KIND_TEXT[kind] + spec.range_text)
        elif not spec.ok(v):
            bad(key, spec.rule)
    for key in _OTHER_KEYS:
        if key in md and not kind_ok("str", md[key]):
            bad(key, KIND_TEXT["str"])
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
    """The model's shape from GGUF metadata (keys as in the published header), each field read
    from its key as its :class:`~mlx_dgemma.schema.ArgSpec` says; :func:`check_args` checks it."""
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise ConvertError(f"{source}: general.architecture is {arch!r}, expected {ARCH!r}; "
                           "this tool converts DiffusionGemma GGUF files only")

    def get(key: str) -> Any:
        if key not in md:
            raise ConvertError(f"{source}: metadata key {key!r} is missing; "
                               "the file is not a complete DiffusionGemma GGUF")
        return md[key]

    specs = arg_specs()
    values: dict[str, Any] = {}
    for f, spec in specs.items():  # single values first: the per-layer ones need the layer count
        if spec.read == "value" and (spec.required or spec.keys[0] in md):
            values[f] = (float if spec.kind == "float" else int)(get(spec.keys[0]))
    n_layers = values["num_hidden_layers"]
    for f, spec in specs.items():
        if spec.read == "pattern":
            key = spec.keys[0]
            pattern = get(key)
            if not isinstance(pattern, list) or len(pattern) != n_layers or \
                    not all(isinstance(x, bool) for x in pattern):
                raise _gguf_bad(source, key, pattern, f"{n_layers} booleans (one per layer)")
            values[f] = [LAYER_TYPES[0] if s else LAYER_TYPES[1] for s in pattern]
    sliding = [t == LAYER_TYPES[0] for t in values["layer_types"]]
    for f, spec in specs.items():
        if spec.read in ("sliding", "global"):  # one value for each layer type
            key = spec.keys[0]
            per = get(key)
            if isinstance(per, list) and len(per) != n_layers:
                raise _gguf_bad(source, key, per, f"{n_layers} integers (one per layer)")
            per = per if isinstance(per, list) else [per] * n_layers
            own = {k for k, s in zip(per, sliding) if s == (spec.read == "sliding")}
            other = {k for k, s in zip(per, sliding) if s != (spec.read == "sliding")}
            if len(own) > 1 or len(other) > 1:
                raise ConvertError(f"{source}: {key} varies within a layer type ({per}); expected one value "
                                   "for sliding and one for global layers")
            values[f] = int((own or other).pop())
        elif spec.read == "rope":
            swa, full = (float(get(k)) for k in spec.keys)
            values[f] = {"sliding_attention": {"rope_type": "default", "rope_theta": swa},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": partial_rotary_factor, "rope_theta": full}}
        elif spec.read == "count":
            values[f] = int(vocab_size)
    return ModelArgs(**values)


def check_args(md: dict[str, Any], args: ModelArgs, source: str) -> None:
    """The model's shape read from a GGUF against its fields' rules (:meth:`ModelArgs.check`),
    each error naming the GGUF key and the value the file holds."""
    specs = arg_specs()
    try:
        args.check(lambda f: specs[f].keys[-1])
    except ModelArgsError as e:
        shown = md[e.name] if e.name in md else e.value
        absent = "" if e.name in md else " (absent: the default)"
        raise ModelFilesError(f"{source}: {e.name} = {short_repr(shown)}{absent}: expected {e.rule}; the file is not "
                              "a valid DiffusionGemma GGUF") from None


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
