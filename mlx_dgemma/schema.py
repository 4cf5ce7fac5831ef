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
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import numpy as np

from mlx_dgemma.errors import ModelArgsError
from mlx_dgemma.params import is_int, is_number

# ---------------------------------------------------------------------------------------------
# config.json


# general.architecture of the GGUFs this reads, and the prefix of their model keys
GGUF_ARCH = "diffusion-gemma"
_G = GGUF_ARCH + "."

# How a GGUF holds a field (ArgSpec.read); the reader (mlx_dgemma.convert.metadata) decodes each:
READS = {
    "value": "the key's value",
    "sliding": "an integer, or one per layer: the sliding layers' value (one for all of them)",
    "global": "an integer, or one per layer: the global layers' value (one for all of them)",
    "pattern": "one boolean per layer, true for a sliding layer: the layer types",
    "rope": "each layer type's rope_theta, sliding first",
    "count": "the array's length",
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def kind_ok(kind: str, v: Any) -> bool:
    """``v`` is of ``kind``: "int", "float" (finite), "str", "list" or "int|list" (of ints);
    :data:`KIND_TEXT` says each in an error. Booleans are not numbers here."""
    if kind == "int":
        return is_int(v)
    if kind == "float":
        return is_number(v)
    if kind == "str":
        return isinstance(v, str)
    if kind == "list":
        return isinstance(v, list)
    if kind == "int|list":
        return is_int(v) or (isinstance(v, list) and all(is_int(x) for x in v))
    return False


KIND_TEXT = {"int": "an integer", "float": "a finite number", "str": "a string", "list": "an array",
             "int|list": "an integer or an array of integers (one per layer)"}


@dataclass(frozen=True)
class ArgSpec:
    """One :class:`ModelArgs` field's sources and valid values, declared beside the field
    (:func:`arg`): the GGUF key it is read from and how (:data:`READS`), its kind and range, and
    the rules it keeps with other fields. :meth:`ModelArgs.check` applies them to config.json
    and to a GGUF alike; each names the field its own way (the GGUF key, ``text_config.<field>``)."""

    kind: str  # KIND_TEXT's "int" / "float"; "layer_types" and "rope" are their fields' own
    low: float | None = None  # inclusive range (of rope_theta for "rope")
    high: float | None = None
    gguf: str | tuple[str, ...] | None = None  # the GGUF key(s) holding it (None: not in a GGUF)
    read: str = "value"  # how the GGUF holds it (READS)
    required: bool = True  # config.json and the GGUF must hold it; else the field's default
    divides: str | None = None  # a divisor of this field's value
    at_most: str | None = None  # at most this field's value
    below: str | None = None  # below this field's value
    why: str = ""  # said after a rule between fields

    def __post_init__(self) -> None:
        # a new field's declaration with a mistyped kind or reading fails at import, not at the first file
        if self.kind not in KIND_TEXT and self.kind not in ("layer_types", "rope") or self.read not in READS:
            raise ValueError(f"ArgSpec({self.kind!r}, read={self.read!r}): kind is one of {', '.join(KIND_TEXT)}, "
                             f"'layer_types' or 'rope'; read is one of {', '.join(READS)}")

    @property
    def keys(self) -> tuple[str, ...]:
        """The GGUF keys it is read from."""
        return () if self.gguf is None else (self.gguf,) if isinstance(self.gguf, str) else self.gguf

    @property
    def range_text(self) -> str:
        def shown(x: float) -> str:  # integers in full (1048576, not 1.04858e+06)
            return str(x) if isinstance(x, int) else f"{x:g}"

        return f" in [{shown(self.low)}, {shown(self.high)}]" if self.low is not None else ""

    @property
    def rule(self) -> str:
        """What one value must be (the words after "expected" in every error about it); the
        per-layer count of ``layer_types`` is :meth:`ModelArgs.check`'s."""
        if self.kind == "layer_types":
            return "entries of " + " / ".join(map(repr, LAYER_TYPES))
        if self.kind == "rope":
            return "{" + ", ".join(LAYER_TYPES) + "} each with rope_theta" + self.range_text
        return KIND_TEXT[self.kind] + self.range_text

    def ok(self, v: Any) -> bool:
        """``v`` is of this field's kind and in its range."""
        if self.kind == "layer_types":
            return isinstance(v, list) and all(isinstance(x, str) and x in LAYER_TYPES for x in v)
        if self.kind == "rope":
            return isinstance(v, dict) and set(v) == set(LAYER_TYPES) and \
                all(isinstance(x, dict) and self.in_range(x.get("rope_theta")) for x in v.values())
        return kind_ok(self.kind, v) and (self.low is None or self.low <= v <= self.high)

    def in_range(self, v: Any) -> bool:
        """``v`` is a finite number in the range (rope_theta's test)."""
        return is_number(v) and self.low <= v <= self.high


def arg(spec: ArgSpec, default: Any = MISSING) -> Any:
    """A :class:`ModelArgs` field declared with its :class:`ArgSpec` (a field with a default need
    not be given unless ``spec.required`` says so)."""
    return field(default=default, metadata={"spec": spec})


def arg_specs() -> dict[str, ArgSpec]:
    """field name -> its :class:`ArgSpec`, in the fields' order (fields without one are not read
    from a GGUF nor checked)."""
    return {f.name: f.metadata["spec"] for f in fields(ModelArgs) if "spec" in f.metadata}


def _token(key: str, default: int) -> Any:
    return arg(ArgSpec("int", 0, 1 << 22, gguf="tokenizer.ggml." + key, required=False, below="vocab_size",
                       why="a token id of the vocabulary"), default)


@dataclass(kw_only=True)
class ModelArgs:
    """A DiffusionGemma model's shape: config.json's ``text_config`` (named as transformers
    names it) plus ``canvas_length`` and ``mask_token_id``, which config.json keeps beside it.

    Each field read from a GGUF declares its key, kind, range and rules (:class:`ArgSpec`):
    the converter reads (``mlx_dgemma.convert.metadata``) and :meth:`check` checks from them,
    and config.json's validation (``mlx_dgemma.validate``) checks the same. A new field is its
    line here (and the code that uses it); the field order is config.json's key order."""

    hidden_size: int = arg(ArgSpec("int", 1, 1 << 20, gguf=_G + "embedding_length"))
    intermediate_size: int = arg(ArgSpec("int", 1, 1 << 22, gguf=_G + "feed_forward_length"))
    num_hidden_layers: int = arg(ArgSpec("int", 1, 512, gguf=_G + "block_count"))
    num_attention_heads: int = arg(ArgSpec("int", 1, 1024, gguf=_G + "attention.head_count"))
    num_key_value_heads: int = arg(ArgSpec("int", 1, 1024, gguf=_G + "attention.head_count_kv", read="sliding",
                                           divides="num_attention_heads"))
    num_global_key_value_heads: int = arg(ArgSpec("int", 1, 1024, gguf=_G + "attention.head_count_kv",
                                                  read="global", divides="num_attention_heads"))
    head_dim: int = arg(ArgSpec("int", 1, 4096, gguf=_G + "attention.key_length_swa"))
    global_head_dim: int = arg(ArgSpec("int", 1, 4096, gguf=_G + "attention.key_length"))
    layer_types: list[str] = arg(ArgSpec("layer_types", gguf=_G + "attention.sliding_window_pattern",
                                         read="pattern"))
    sliding_window: int = arg(ArgSpec("int", 1, 1 << 24, gguf=_G + "attention.sliding_window"))
    rope_parameters: dict[str, dict[str, Any]] = arg(ArgSpec(
        "rope", 1e-6, 1e30, gguf=(_G + "rope.freq_base_swa", _G + "rope.freq_base"), read="rope"))
    rms_norm_eps: float = arg(ArgSpec("float", 1e-30, 1.0, gguf=_G + "attention.layer_norm_rms_epsilon"), 1e-6)
    vocab_size: int = arg(ArgSpec("int", 1, 1 << 22, gguf="tokenizer.ggml.tokens", read="count"))
    num_experts: int = arg(ArgSpec("int", 1, 4096, gguf=_G + "expert_count"))
    top_k_experts: int = arg(ArgSpec("int", 1, 4096, gguf=_G + "expert_used_count", at_most="num_experts"))
    moe_intermediate_size: int = arg(ArgSpec("int", 1, 1 << 22, gguf=_G + "expert_feed_forward_length"))
    final_logit_softcapping: float = arg(ArgSpec("float", 1e-6, 1e6, gguf=_G + "final_logit_softcapping",
                                                 required=False), 30.0)
    max_position_embeddings: int = arg(ArgSpec("int", 1, 1 << 24, gguf=_G + "context_length"), 262144)
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    pad_token_id: int = _token("padding_token_id", 0)
    bos_token_id: int = _token("bos_token_id", 2)
    eos_token_id: int = _token("eos_token_id", 1)
    model_type: str = "diffusion_gemma_text"
    # config.json top level, not text_config
    canvas_length: int = arg(ArgSpec("int", 1, 1 << 16, gguf="diffusion.canvas_length", required=False,
                                      below="max_position_embeddings",
                                      why="a canvas and its prompt must fit in the context"), 256)
    mask_token_id: int = _token("mask_token_id", 4)
    # text_config keys this version does not know, kept so a config round-trips
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelArgs":
        """From a converted directory's config.json (``text_config`` plus canvas settings), its
        values as they are (:meth:`check` says whether they are valid)."""
        tc = dict(config.get("text_config", config))
        names = {f.name for f in fields(cls)} - {"extra"}
        args = {k: tc[k] for k in names if k in tc}
        for k in _TOP_LEVEL:
            args[k] = config.get(k, getattr(cls, k))
        return cls(**args, extra={k: v for k, v in tc.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        """config.json's ``text_config`` section (``canvas_length`` and ``mask_token_id`` are
        written beside it, not in it)."""
        d = asdict(self)
        for k in _TOP_LEVEL:
            del d[k]
        d.update(d.pop("extra"))
        return d

    @staticmethod
    def config_name(f: str) -> str:
        """A field's name in config.json: ``text_config.<field>``, or the field itself beside it."""
        return f if f in _TOP_LEVEL else f"text_config.{f}"

    def check(self, name: Callable[[str], str] = str) -> None:
        """Every field's kind and range, then the rules between fields, as :class:`ArgSpec`
        declares them. ``name`` gives a field's name in the source's words (the GGUF key,
        ``text_config.<field>``); a rule names the other field relative to the one at fault
        (``at most num_experts = 8`` beside ``text_config.top_k_experts``). Raises
        :class:`~mlx_dgemma.errors.ModelArgsError` (field, name, rule, value) for the first fault."""
        specs = arg_specs()

        def fail(f: str, rule: str) -> None:
            raise ModelArgsError(f, name(f), rule, getattr(self, f))

        def ref(f: str, other: str) -> tuple[str, Any]:
            return _relative(name(other), name(f)), getattr(self, other)

        for f, spec in specs.items():
            v = getattr(self, f)
            if spec.kind == "layer_types":  # one per layer: the count is part of its rule
                n = self.num_hidden_layers
                if isinstance(v, list) and len(v) == n and not spec.ok(v):  # name the entry at fault
                    i = next(i for i, x in enumerate(v) if not spec.ok([x]))
                    raise ModelArgsError(f, f"{name(f)}[{i}]", " or ".join(map(repr, LAYER_TYPES)), v[i])
                if not spec.ok(v) or len(v) != n:
                    fail(f, f"{n} {spec.rule}" + (f", one a layer (it has {len(v)})" if isinstance(v, list) else ""))
            elif not spec.ok(v):
                fail(f, spec.rule)
            elif spec.kind == "rope":  # the share of global layers' dimensions rotated
                prf = v["full_attention"].get("partial_rotary_factor", 1.0)
                if not (is_number(prf) and 0 < prf <= 1):
                    raise ModelArgsError(f, name(f) + ".full_attention.partial_rotary_factor", "a number in (0, 1]",
                                         prf)
        for f, spec in specs.items():
            v, why = getattr(self, f), f" ({spec.why})" if spec.why else ""
            if spec.divides:
                other, limit = ref(f, spec.divides)
                if limit % v:
                    fail(f, f"a divisor of {other} = {limit}{why}")
            if spec.at_most:
                other, limit = ref(f, spec.at_most)
                if v > limit:
                    fail(f, f"at most {other} = {limit}{why}")
            if spec.below:
                other, limit = ref(f, spec.below)
                if v >= limit:
                    fail(f, f"at most {limit - 1}, below {other} = {limit}{why}")

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"


_TOP_LEVEL = ("canvas_length", "mask_token_id")


def _relative(other: str, subject: str) -> str:
    """``other``'s dotted name without the sections it shares with ``subject``
    (``text_config.num_experts`` beside ``text_config.top_k_experts``: ``num_experts``)."""
    a, b = other.split("."), subject.split(".")
    i = 0
    while i < min(len(a), len(b)) - 1 and a[i] == b[i]:
        i += 1
    return ".".join(a[i:])


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
