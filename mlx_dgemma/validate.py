"""Validation at the boundaries, once: a GGUF file (structure, then metadata) and a converted
directory (config.json, safetensors headers, tokenizer, generation config, chat template).

Everything here runs before any real work and never allocates from a count found in a file
before checking it against the file's size. Every error names the file and the key (or
tensor) and says what was expected. Pure Python and NumPy: no MLX, so ``convert`` and
``verify`` use it as cheaply as ``load`` does.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import params
from .errors import ModelFilesError, ParameterError
from .paths import input_problem

ARCH = "diffusion-gemma"

# ---------------------------------------------------------------------------------------------
# Generation parameters (generation_config.json, GGUF diffusion.eb_* keys, CLI flags, API)

# the range rules: the registry's parameters (mlx_dgemma.params), and the token ids the model's
# generation_config.json carries beside them
GENERATION_RULES: dict[str, tuple[str, Any, Any, str]] = {  # name: (kind, low, high, rule text)
    **{p.name: (p.kind.__name__, p.low, p.high, p.rule) for p in params.PARAMS},
    "pad_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
    "bos_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
    "mask_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_generation_field(name: str, value: Any) -> None:
    """One generation parameter against its type and range (None allowed for the run's own
    settings, off by default: ``model_default=False`` in the registry)."""
    if name == "eos_token_id":
        ids = value if isinstance(value, (list, tuple)) else [value]
        if not ids or not all(_is_int(i) and 0 <= i < 2**31 for i in ids):
            raise ParameterError(f"eos_token_id = {value!r}: must be a token id or a list of token ids",
                                 param=name, rule="a token id or a list of token ids")
        return
    param = params.get(name)
    rule = (param.kind.__name__, param.low, param.high, param.rule) if param else GENERATION_RULES.get(name)
    if rule is None or (value is None and param is not None and not param.model_default):
        return
    kind, low, high, text = rule
    ok = (_is_int(value) if kind == "int" else _is_num(value)) and low <= value <= high
    if not ok:
        raise ParameterError(f"{name} = {value!r}: must be {text}", param=name, rule=text)


def check_generation_config(cfg: Any, source: str, vocab_size: int | None = None) -> None:
    """generation_config.json (or the GGUF's defaults): known keys typed and in range."""
    if not isinstance(cfg, dict):
        raise ModelFilesError(f"{source}: expected a JSON object of generation settings, got "
                              f"{type(cfg).__name__}; convert the model again")
    for k, v in cfg.items():
        try:
            check_generation_field(k, v)
        except ParameterError as e:
            raise ModelFilesError(f"{source}: {k} = {_short(v)}: must be {e.rule}; fix the file or "
                                  "convert the model again") from None
        if vocab_size is not None and k.endswith("token_id"):
            ids = v if isinstance(v, (list, tuple)) else [v]
            if any(i >= vocab_size for i in ids):
                raise ModelFilesError(f"{source}: {k} = {_short(v)}: must be below the vocabulary size "
                                      f"{vocab_size}")
    t_min, t_max = cfg.get("t_min", 0.4), cfg.get("t_max", 0.8)
    if not t_max > t_min:
        raise ModelFilesError(f"{source}: t_min = {t_min}, t_max = {t_max}: the schedule needs t_min < t_max")


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# GGUF structure: a bounded pre-scan before gguf-py parses anything

_SCALARS = {0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
            5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 10: ("uint64", 8), 11: ("int64", 8),
            12: ("float64", 8)}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


@dataclass
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    n_bytes: int


@dataclass
class GGUFScan:
    """What the pre-scan found: value types per key and the tensor table, all inside the file."""

    version: int
    size: int
    kinds: dict[str, tuple[str, str | None, int]] = field(default_factory=dict)  # key: (type, item type, count)
    arch: str | None = None
    alignment: int = 32
    data_start: int = 0
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf, size: int, source: str, error: type[Exception]):
        self.buf, self.size, self.pos, self.source, self.error = buf, size, 0, source, error

    def fail(self, what: str) -> None:
        raise self.error(f"{self.source}: {what} (at byte {self.pos} of {self.size}); the file is truncated "
                         "or corrupt, download it again")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} needs {n} bytes, past the end of the file")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str, decode: bool = True) -> str | None:
        n = self.unpack("<Q", what)
        self.need(n, what)
        if not decode:
            self.pos += n
            return None
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")
        return None


_U64 = struct.Struct("<Q")


def _strings(c: _Cursor, count: int, key: str) -> None:
    """Skip ``count`` length-prefixed strings, each inside the file and UTF-8 (they end up in
    JSON files); the hot loop of a 262k-token vocabulary, hence the local names."""
    buf, pos, end, unpack = c.buf, c.pos, c.size, _U64.unpack_from
    try:
        for i in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                break
            buf[pos:pos + n].decode("utf-8")
            pos += n
        else:
            c.pos = pos
            return
    except UnicodeDecodeError:
        c.pos = pos
        c.fail(f"item {i} of {key!r} is not valid UTF-8")
    c.pos = pos
    c.fail(f"item {i} of {key!r} needs more bytes than the file has")


def scan_gguf(path: Path, source: str | None = None, error: type[Exception] = ModelFilesError,
              expect_arch: str | None = ARCH) -> GGUFScan:
    """Walk a GGUF's header, metadata and tensor table with every count checked against the
    bytes left, before anything is allocated from it. Stops early (cheaply) on another
    ``general.architecture``. Checks tensor types, shapes, alignment, bounds and overlaps."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    source = source or str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            raise error(f"{source}: {size} bytes is too short for a GGUF header; the file is truncated")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            # slices of an mmap are bytes copies: no exported buffer outlives an error
            return _scan(_Cursor(mm, size, source, error), size, error, expect_arch, GGML_QUANT_SIZES,
                         GGMLQuantizationType)


def _scan(c: _Cursor, size: int, error, expect_arch, quant_sizes, qtypes) -> GGUFScan:
    source = c.source
    magic = bytes(c.buf[:4])
    if magic != b"GGUF":
        raise error(f"{source}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    c.pos = 4
    version = c.unpack("<I", "version")
    if version not in (2, 3):
        raise error(f"{source}: GGUF version {version} is not supported (expected 2 or 3; a big-endian "
                    "or future file); convert it with a current llama.cpp")
    n_tensors = c.unpack("<Q", "tensor count")
    n_kv = c.unpack("<Q", "metadata count")
    if n_kv > (size - c.pos) // 13 or n_tensors > (size - c.pos) // 24:
        c.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")
    scan = GGUFScan(version, size)
    for _ in range(n_kv):
        key = c.string("metadata key")
        if key in scan.kinds:
            c.fail(f"metadata key {key!r} appears twice")
        vtype = c.unpack("<I", f"type of {key!r}")
        if vtype == _STRING:
            value = c.string(f"value of {key!r}")
            if key == "general.architecture":  # usually the first key: a wrong file is refused at once
                scan.arch = value
                if expect_arch is not None and value != expect_arch:
                    raise error(f"{source}: general.architecture is {value!r}, expected {expect_arch!r}; "
                                "this tool reads DiffusionGemma GGUF files only")
            scan.kinds[key] = ("string", None, 1)
        elif vtype in _SCALARS:
            name, n = _SCALARS[vtype]
            c.need(n, f"value of {key!r}")
            if key == "general.alignment":
                scan.alignment = int.from_bytes(c.buf[c.pos:c.pos + n], "little") if name.startswith("uint") else -1
            c.pos += n
            scan.kinds[key] = (name, None, 1)
        elif vtype == _ARRAY:
            itype = c.unpack("<I", f"item type of {key!r}")
            count = c.unpack("<Q", f"length of {key!r}")
            if itype in _SCALARS:
                iname, n = _SCALARS[itype]
                if count > (size - c.pos) // n:
                    c.fail(f"array {key!r} claims {count} items of {n} bytes, more than the file holds")
                c.pos += count * n
            elif itype == _STRING:
                iname = "string"
                if count > (size - c.pos) // 8:
                    c.fail(f"array {key!r} claims {count} strings, more than the file holds")
                _strings(c, count, key)
            else:  # nested arrays: no DiffusionGemma key uses them
                c.fail(f"metadata {key!r} is an array of type {itype}; only arrays of numbers, booleans or "
                       "strings are supported")
            scan.kinds[key] = ("array", iname, count)
        else:
            c.fail(f"metadata {key!r} has unknown value type {vtype}")
    align = scan.alignment
    if align < 1 or align > 1 << 20 or align & (align - 1):
        raise error(f"{source}: general.alignment = {align}: must be a power of two up to 1048576")
    names = set()
    infos = []
    for _ in range(n_tensors):
        name = c.string("tensor name")
        if name in names:
            c.fail(f"tensor {name!r} appears twice in the tensor table")
        names.add(name)
        n_dims = c.unpack("<I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            c.fail(f"tensor {name!r} has {n_dims} dimensions (expected 1 to {_MAX_DIMS})")
        dims = tuple(c.unpack("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        ttype = c.unpack("<I", f"type of tensor {name!r}")
        offset = c.unpack("<Q", f"offset of tensor {name!r}")
        try:
            qt = qtypes(ttype)
            block, type_size = quant_sizes[qt]
        except (ValueError, KeyError):
            raise error(f"{source}: tensor {name!r} has unknown ggml type {ttype}; the file is corrupt or "
                        "from a newer llama.cpp") from None
        n = math.prod(dims)
        if any(d < 1 for d in dims) or n >= 1 << 48:
            raise error(f"{source}: tensor {name!r} has shape {list(dims)}; each dimension must be >= 1 "
                        "and the total below 2**48")
        if dims[0] % block:
            raise error(f"{source}: tensor {name!r} has a row of {dims[0]} values, not a multiple of the "
                        f"{qt.name} block size {block}")
        if offset % align:
            raise error(f"{source}: tensor {name!r} starts at offset {offset}, not a multiple of the "
                        f"alignment {align}")
        infos.append((name, dims, ttype, offset, n // block * type_size))
    data_start = c.pos + (-c.pos) % align
    scan.data_start = data_start
    for name, dims, ttype, offset, nb in infos:
        start = data_start + offset
        if start + nb > size:
            raise error(f"{source}: tensor {name!r} ({nb} bytes at {start}) ends past the end of the file "
                        f"({size} bytes); the file is truncated, download it again")
        scan.tensors.append(GGUFTensorInfo(name, dims, ttype, start, nb))
    spans = sorted(scan.tensors, key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise error(f"{source}: tensors {a.name!r} and {b.name!r} overlap in the file (bytes "
                        f"{a.offset}..{a.offset + a.n_bytes} and {b.offset}..); the file is corrupt")
    return scan


# ---------------------------------------------------------------------------------------------
# GGUF metadata values

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
_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "mask")


def _kind_ok(kind: str, v: Any) -> bool:
    if kind == "int":
        return _is_int(v)
    if kind == "float":
        return _is_num(v)
    if kind == "str":
        return isinstance(v, str)
    if kind == "list":
        return isinstance(v, list)
    if kind == "int|list":
        return _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v))
    return False


_KIND_TEXT = {"int": "an integer", "float": "a finite number", "str": "a string", "list": "an array",
              "int|list": "an integer or an array of integers (one per layer)"}


def check_gguf_metadata(md: dict[str, Any], kinds: dict[str, tuple[str, str | None, int]], source: str) -> int:
    """Types, ranges and cross-field consistency of a DiffusionGemma GGUF's metadata. ``kinds``
    (from :func:`scan_gguf`) covers the long tokenizer arrays that ``md`` only summarizes.
    Returns the vocabulary size."""
    def bad(key: str, rule: str) -> None:
        raise ModelFilesError(f"{source}: {key} = {_short(md.get(key))}: expected {rule}; the file is not a "
                              "valid DiffusionGemma GGUF")

    for key, (kind, low, high, required) in _GGUF_KEYS.items():
        if key not in md:
            if required:
                raise ModelFilesError(f"{source}: metadata key {key!r} is missing; the file is not a complete "
                                      "DiffusionGemma GGUF")
            continue
        v = md[key]
        if not _kind_ok(kind, v):
            bad(key, _KIND_TEXT[kind])
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
    ctx, canvas = md[_P + "context_length"], md.get("diffusion.canvas_length", 256)
    if canvas >= ctx:  # a block needs the canvas and at least one prompt token in the context
        shown = "" if "diffusion.canvas_length" in md else " (absent: the default)"
        raise ModelFilesError(f"{source}: diffusion.canvas_length = {canvas}{shown}: expected at most {ctx - 1}, "
                              f"below {_P}context_length = {ctx} (a canvas and its prompt must fit in the "
                              "context); the file is not a valid DiffusionGemma GGUF")
    for key, param in params.gguf_keys().items():  # diffusion.eb_*: sampler defaults
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
                raise ModelFilesError(f"{source}: {key}: expected an array of {vocab} numbers (one per token)")
        k = kinds.get("tokenizer.ggml.merges")
        if k is not None and (k[0] != "array" or k[1] != "string"):
            raise ModelFilesError(f"{source}: tokenizer.ggml.merges: expected an array of strings 'a b'")
        model = md.get("tokenizer.ggml.model", "gemma4")
        if model not in ("gemma4", "llama"):
            bad("tokenizer.ggml.model", "'gemma4' or 'llama'")
        for name in _TOKEN_IDS:
            key = f"tokenizer.ggml.{name}_token_id"
            if key in md and not (_is_int(md[key]) and 0 <= md[key] < vocab):
                bad(key, f"a token id in [0, {vocab})")
    if "tokenizer.chat_template" in md:
        check_chat_template(md["tokenizer.chat_template"], f"{source}: tokenizer.chat_template")
    return vocab


def check_chat_template(text: str, source: str) -> None:
    """A chat template must compile in the sandbox (syntax errors named with their line)."""
    from jinja2 import TemplateError

    from .chat_template import compile_template

    try:
        compile_template(text)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ModelFilesError(f"{source}: the chat template does not compile ({e.__class__.__name__}"
                              f"{f' at line {line}' if line else ''}: {e.message if hasattr(e, 'message') else e}); "
                              "fix or remove it") from None
    except (RecursionError, MemoryError):
        raise ModelFilesError(f"{source}: the chat template is too deeply nested to compile; fix or remove it") \
            from None


# ---------------------------------------------------------------------------------------------
# Tokenizer data (tokenizer_gguf.json, or the GGUF's tokenizer.* keys as plain Python)

def check_tokenizer_data(data: Any, source: str, vocab_size: int | None = None) -> None:
    """tokenizer_gguf.json: types, ids in range, merges well formed (before the backend sees it)."""
    def bad(key: str, rule: str) -> None:
        raise ModelFilesError(f"{source}: {key}: expected {rule}; convert the model again")

    if not isinstance(data, dict):
        raise ModelFilesError(f"{source}: expected a JSON object, got {type(data).__name__}; convert the model again")
    tokens = data.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        bad("tokenizer.ggml.tokens", "a non-empty list of strings")
    n = len(tokens)
    if vocab_size is not None and n != vocab_size:
        bad("tokenizer.ggml.tokens", f"{vocab_size} tokens (the model's vocabulary), found {n}")
    kind = data.get("tokenizer.ggml.model")
    if kind not in ("gemma4", "llama"):
        bad("tokenizer.ggml.model", "'gemma4' or 'llama'")
    types = data.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != n or not all(_is_int(t) for t in types)):
        bad("tokenizer.ggml.token_type", f"a list of {n} integers")
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in data and not (_is_int(data[key]) and 0 <= data[key] < n):
            bad(key, f"a token id in [0, {n})")
    merges = data.get("tokenizer.ggml.merges", [])
    if kind == "gemma4":
        if not isinstance(merges, list):
            bad("tokenizer.ggml.merges", "a list of strings 'left right'")
        vocab = set(tokens)
        for i, m in enumerate(merges):
            if not isinstance(m, str) or " " not in m:
                bad(f"tokenizer.ggml.merges[{i}]", "a string 'left right'")
            left, right = m.split(" ", 1)
            if left not in vocab or right not in vocab:
                bad(f"tokenizer.ggml.merges[{i}] = {_short(m)}", "two tokens of the vocabulary")


# ---------------------------------------------------------------------------------------------
# Converted directories

_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "U8": 1, "I32": 4, "U16": 2, "I8": 1, "I16": 2,
              "F64": 8, "I64": 8, "U64": 8, "BOOL": 1}
_MAX_ST_HEADER = 100 << 20

# text_config key: (kind, low, high)
_TEXT_CONFIG = {
    "hidden_size": ("int", 1, 1 << 20), "intermediate_size": ("int", 1, 1 << 22),
    "num_hidden_layers": ("int", 1, 512), "num_attention_heads": ("int", 1, 1024),
    "num_key_value_heads": ("int", 1, 1024), "num_global_key_value_heads": ("int", 1, 1024),
    "head_dim": ("int", 1, 4096), "global_head_dim": ("int", 1, 4096),
    "sliding_window": ("int", 1, 1 << 24), "vocab_size": ("int", 1, 1 << 22),
    "num_experts": ("int", 1, 4096), "top_k_experts": ("int", 1, 4096),
    "moe_intermediate_size": ("int", 1, 1 << 22), "rms_norm_eps": ("float", 1e-30, 1.0),
    "max_position_embeddings": ("int", 1, 1 << 24),
}
_BITS = {2, 3, 4, 5, 6, 8}


def read_json(path: Path, what: str = "a JSON object") -> Any:
    """Parse a JSON file; errors name the file and the position."""
    try:
        with open(path, "rb") as f:
            raw = f.read(256 << 20)
        return json.loads(raw)
    except OSError as e:
        raise ModelFilesError(f"{path}: cannot read ({e.strerror or e}); convert the model again") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise ModelFilesError(f"{path}: not valid JSON ({str(e)[:80]}); expected {what}, convert the model "
                              "again") from None


def check_config(config: Any, source: str) -> None:
    """config.json of a converted directory: keys, types, ranges, cross-field consistency."""
    def bad(key: str, rule: str, value: Any = None) -> None:
        raise ModelFilesError(f"{source}: {key} = {_short(value)}: expected {rule}; convert the model again")

    if not isinstance(config, dict):
        raise ModelFilesError(f"{source}: expected a JSON object, got {type(config).__name__}; convert the "
                              "model again")
    if config.get("model_type") != "diffusion_gemma":
        raise ModelFilesError(f"{source}: model_type is {config.get('model_type')!r}, expected 'diffusion_gemma'")
    for key, low, high in (("canvas_length", 1, 1 << 16), ("mask_token_id", 0, 1 << 22)):
        v = config.get(key)
        if v is not None and not (_is_int(v) and low <= v <= high):
            bad(key, f"an integer in [{low}, {high}]", v)
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        bad("text_config", "an object", tc)
    for key, (kind, low, high) in _TEXT_CONFIG.items():
        if key not in tc:
            raise ModelFilesError(f"{source}: text_config.{key} is missing; convert the model again")
        v = tc[key]
        if not _kind_ok(kind, v) or not low <= v <= high:
            bad(f"text_config.{key}", f"{_KIND_TEXT[kind]} in [{low:g}, {high:g}]", v)
    n = tc["num_hidden_layers"]
    lt = tc.get("layer_types")
    if not isinstance(lt, list) or len(lt) != n or not all(x in ("sliding_attention", "full_attention") for x in lt):
        bad("text_config.layer_types", f"{n} entries of 'sliding_attention' / 'full_attention'", lt)
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        if tc["num_attention_heads"] % tc[key]:
            bad(f"text_config.{key}", "a divisor of num_attention_heads", tc[key])
    if tc["top_k_experts"] > tc["num_experts"]:
        bad("text_config.top_k_experts", f"at most num_experts = {tc['num_experts']}", tc["top_k_experts"])
    sc = tc.get("final_logit_softcapping")
    if sc is not None and not (_is_num(sc) and sc > 0):
        bad("text_config.final_logit_softcapping", "a number > 0 or null", sc)
    rp = tc.get("rope_parameters")
    if not isinstance(rp, dict) or set(rp) != {"sliding_attention", "full_attention"} or \
            not all(isinstance(x, dict) and _is_num(x.get("rope_theta")) and x["rope_theta"] > 0 for x in rp.values()):
        bad("text_config.rope_parameters", "{sliding_attention, full_attention} each with rope_theta > 0", rp)
    prf = rp["full_attention"].get("partial_rotary_factor", 1.0)
    if not (_is_num(prf) and 0 < prf <= 1):
        bad("text_config.rope_parameters.full_attention.partial_rotary_factor", "a number in (0, 1]", prf)
    canvas, ctx = config.get("canvas_length", 256), tc["max_position_embeddings"]
    if canvas >= ctx:  # a block needs the canvas and at least one prompt token in the context
        bad("canvas_length", f"at most {ctx - 1}, below text_config.max_position_embeddings = {ctx} (a canvas and "
            "its prompt must fit in the context)", canvas)
    mt = config.get("mask_token_id", 4)
    if mt >= tc["vocab_size"]:
        bad("mask_token_id", f"a token id below vocab_size = {tc['vocab_size']}", mt)
    q = config.get("quantization", {})
    if not isinstance(q, dict):
        bad("quantization", "an object", q)
    for k, v in q.items():
        if k in ("group_size", "bits"):
            if not (_is_int(v) and (v in _BITS if k == "bits" else v in (32, 64, 128))):
                bad(f"quantization.{k}", "bits in {2,3,4,5,6,8}" if k == "bits" else "32, 64 or 128", v)
        elif isinstance(v, dict):
            if not (_is_int(v.get("bits")) and v["bits"] in _BITS and v.get("group_size", 32) in (32, 64, 128)
                    and v.get("subblock", 32) in (16, 32)):
                bad(f"quantization[{k!r}]", "bits in {2,3,4,5,6,8}, group_size 32/64/128, subblock 16/32", v)


def check_safetensors(path: Path) -> dict[str, dict]:
    """A safetensors file's header: length bounded by the file, JSON, entries typed and inside
    the data section, sizes matching shapes, no overlaps. Returns the entries."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFilesError(f"{path}: {size} bytes is too short for a safetensors file; convert again")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > _MAX_ST_HEADER:
            raise ModelFilesError(f"{path}: the header claims {n} bytes but the file has {size}; the file is "
                                  "truncated or corrupt, convert the model again")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        raise ModelFilesError(f"{path}: the safetensors header is not valid JSON; convert the model again") from None
    if not isinstance(header, dict):
        raise ModelFilesError(f"{path}: the safetensors header is not a JSON object; convert the model again")
    data = size - 8 - n
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, e in entries.items():
        if not name.isprintable():
            raise ModelFilesError(f"{path}: tensor name {name!r} has control characters; the file is corrupt, "
                                  "convert the model again")
        ok = isinstance(e, dict) and e.get("dtype") in _ST_DTYPES and isinstance(e.get("shape"), list) \
            and all(_is_int(d) and 0 <= d < 1 << 40 for d in e["shape"]) and len(e["shape"]) <= 8 \
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 \
            and all(_is_int(x) for x in e["data_offsets"])
        if not ok:
            raise ModelFilesError(f"{path}: tensor {name!r} has a malformed header entry {_short(e)}; convert "
                                  "the model again")
        a, b = e["data_offsets"]
        if not 0 <= a <= b <= data:
            raise ModelFilesError(f"{path}: tensor {name!r} lies at bytes {a}..{b}, outside the data section "
                                  f"({data} bytes); the file is truncated or corrupt, convert again")
        if b - a != math.prod(e["shape"]) * _ST_DTYPES[e["dtype"]]:
            raise ModelFilesError(f"{path}: tensor {name!r} has {b - a} bytes but shape {e['shape']} of "
                                  f"{e['dtype']} needs {math.prod(e['shape']) * _ST_DTYPES[e['dtype']]}; convert again")
        spans.append((a, b, name))
    spans.sort()
    for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
        if b0 > a1:
            raise ModelFilesError(f"{path}: tensors {n0!r} and {n1!r} overlap; convert the model again")
    return entries


def model_dir_shards(path: Path) -> list[Path]:
    """The shard files of a converted directory (the index's, which must match the directory)."""
    index = path / "model.safetensors.index.json"
    present = sorted(p.name for p in path.glob("*.safetensors"))
    if index.is_file():
        idx = read_json(index)
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ModelFilesError(f"{index}: weight_map: expected an object of tensor name -> shard file; "
                                  "convert the model again")
        listed = sorted(set(wm.values()))
        for f in listed:
            if "/" in f or f.startswith(".") or not (path / f).is_file():
                raise ModelFilesError(f"{path / f}: shard listed in the index is missing; convert again")
        extra = sorted(set(present) - set(listed))
        if extra:
            raise ModelFilesError(f"{path / extra[0]}: a shard that model.safetensors.index.json does not list; "
                                  "remove it or convert the model again")
        return [path / f for f in listed]
    if not present:
        raise ModelFilesError(f"{path}: no .safetensors weights; convert the model again")
    return [path / f for f in present]


def check_quantized_shapes(config: dict, stored: dict[str, tuple[Path, dict]], source: str) -> None:
    """Each quantized weight's stored arrays agree with its ``quantization`` entry (bits and
    group size), as ``mx.dequantize`` needs: a packed row of W uint32 words holds
    ``W * 32 / bits`` values, which its scales and biases cover in groups of ``group_size``.
    ``stored``: tensor name -> (shard, safetensors header entry), checked already."""
    for module, spec in config.get("quantization", {}).items():
        if not isinstance(spec, dict):
            continue
        parts = [stored.get(f"{module}.{p}") for p in ("weight", "scales", "biases")]
        if any(x is None for x in parts):  # not stored quantized: the loader and verify name what is missing
            continue
        (shard, w), (_, sc), (_, b) = parts
        bits, group = spec["bits"], spec.get("group_size", 32)
        ws, ss = w["shape"], sc["shape"]
        if w["dtype"] != "U32" or len(ws) < 1 or len(ws) != len(ss) or ws[:-1] != ss[:-1] or b["shape"] != ss:
            raise ModelFilesError(f"{shard}: tensor {module + '.weight'!r} ({w['dtype']} {ws}) and its scales "
                                  f"{ss} / biases {b['shape']} are not a quantized weight of one shape; convert "
                                  "the model again")
        values, covered = ws[-1] * 32 / bits, ss[-1] * group
        if values != covered:
            raise ModelFilesError(
                f"{source}: quantization[{module!r}] (bits {bits}, group_size {group}) does not match the stored "
                f"tensor {module + '.weight'!r} in {shard.name}: its {ws[-1]} uint32 words per row hold {values:g} "
                f"values at {bits} bits, its {ss[-1]} scales cover {covered}; convert the model again")


def check_model_dir(path: str | Path) -> dict:
    """Validate a converted directory before loading anything; returns its config."""
    path = Path(path)
    for name in ("config.json", "tokenizer_gguf.json"):
        problem = input_problem(path / name, want_dir=False)
        if problem is not None and (path / name).exists():  # a directory, FIFO, device, unreadable file
            raise ModelFilesError(f"{path / name}: {problem}; give a directory written by `mlx-dgemma convert` "
                                  "(or a .gguf file)")
        if problem is not None:
            raise ModelFilesError(f"{path}: {name} is missing; give a directory written by "
                                  "`mlx-dgemma convert` (or a .gguf file)")
    config = read_json(path / "config.json")
    check_config(config, str(path / "config.json"))
    vocab = config["text_config"]["vocab_size"]
    stored: dict[str, tuple[Path, dict]] = {}
    for f in model_dir_shards(path):
        stored.update((name, (f, e)) for name, e in check_safetensors(f).items())
    check_quantized_shapes(config, stored, str(path / "config.json"))
    check_tokenizer_data(read_json(path / "tokenizer_gguf.json"), str(path / "tokenizer_gguf.json"), vocab)
    gen = path / "generation_config.json"
    if gen.is_file():
        check_generation_config(read_json(gen), str(gen), vocab)
    tmpl = path / "chat_template.jinja"
    if tmpl.is_file():
        try:
            text = tmpl.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            raise ModelFilesError(f"{tmpl}: not readable UTF-8 text; fix or remove it") from None
        check_chat_template(text, str(tmpl))
    return config
