"""Validation of a converted directory, once: config.json, safetensors headers, shards,
tokenizer data, generation config and chat template.

Everything here runs before any real work and never allocates from a count found in a file
before checking it against the file's size. Every error names the file and the key (or
tensor) and says what was expected. Pure Python and NumPy: no MLX, so ``convert`` and
``verify`` use it as cheaply as ``load`` does.

The generation parameters are checked where they are declared (``mlx_dgemma.params``); a GGUF
itself (its binary layout and its metadata) in the converter package
(``mlx_dgemma.convert.scan``, ``mlx_dgemma.convert.metadata``), which reuses the value checks
below and which the core reaches only through ``GGUFSource``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from . import formats
from .errors import ModelArgsError, ModelFilesError, ParameterError
from .params import check_generation_field, is_int
from .paths import input_problem
from .schema import SAFETENSORS_DTYPES, ModelArgs, SamplerDefaults, arg_specs
from .sidecar import SIDECAR_FILE
from .tiers import STORED_FORMS, TIERS

# ---------------------------------------------------------------------------------------------
# Values typed and quoted in the errors below (and in convert's GGUF metadata checks)


def short_repr(v: Any, n: int = 60) -> str:
    """``repr(v)`` cut to ``n`` characters: a value quoted in a one-line error."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


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

# the tokenizer kinds the backend builds (tokenizer.ggml.model)
TOKENIZER_MODELS = ("gemma4", "llama")
# the special tokens' ids, each checked against the vocabulary
TOKEN_ID_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding", "mask"))


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
    if kind not in TOKENIZER_MODELS:
        bad("tokenizer.ggml.model", " or ".join(map(repr, TOKENIZER_MODELS)))
    types = data.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != n or not all(is_int(t) for t in types)):
        bad("tokenizer.ggml.token_type", f"a list of {n} integers")
    for key in TOKEN_ID_KEYS:
        if key in data and not (is_int(data[key]) and 0 <= data[key] < n):
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
                bad(f"tokenizer.ggml.merges[{i}] = {short_repr(m)}", "two tokens of the vocabulary")


# ---------------------------------------------------------------------------------------------
# Converted directories

_MAX_ST_HEADER = 100 << 20

_BITS = {2, 3, 4, 5, 6, 8}


def check_generation_config(cfg: Any, source: str, vocab_size: int | None = None) -> None:
    """generation_config.json (or the GGUF's defaults): known keys typed and in range."""
    if not isinstance(cfg, dict):
        raise ModelFilesError(f"{source}: expected a JSON object of generation settings, got "
                              f"{type(cfg).__name__}; convert the model again")
    for k, v in cfg.items():
        try:
            check_generation_field(k, v)
        except ParameterError as e:
            raise ModelFilesError(f"{source}: {k} = {short_repr(v)}: must be {e.rule}; fix the file or "
                                  "convert the model again") from None
        if vocab_size is not None and k.endswith("token_id"):
            ids = v if isinstance(v, (list, tuple)) else [v]
            if any(i >= vocab_size for i in ids):
                raise ModelFilesError(f"{source}: {k} = {short_repr(v)}: must be below the vocabulary size "
                                      f"{vocab_size}")
    t_min, t_max = cfg.get("t_min", SamplerDefaults.t_min), cfg.get("t_max", SamplerDefaults.t_max)
    if not t_max > t_min:
        raise ModelFilesError(f"{source}: t_min = {t_min}, t_max = {t_max}: the schedule needs t_min < t_max")


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
        raise ModelFilesError(f"{source}: {key} = {short_repr(value)}: expected {rule}; convert the model again")

    if not isinstance(config, dict):
        raise ModelFilesError(f"{source}: expected a JSON object, got {type(config).__name__}; convert the "
                              "model again")
    if config.get("model_type") != "diffusion_gemma":
        raise ModelFilesError(f"{source}: model_type is {config.get('model_type')!r}, expected 'diffusion_gemma'")
    tc = config.get("text_config")
    if "text_config" not in config:
        raise ModelFilesError(f"{source}: text_config is missing (the model's shape); convert the model again")
    if not isinstance(tc, dict):
        bad("text_config", "an object", tc)
    for f, spec in arg_specs().items():  # the model's shape: ModelArgs' fields and their rules
        if spec.required and f not in tc:
            raise ModelFilesError(f"{source}: text_config.{f} is missing; convert the model again")
    try:
        ModelArgs.from_config(config).check(ModelArgs.config_name)
    except ModelArgsError as e:
        bad(e.name, e.rule, e.value)
    section = config.get("mlx_dgemma", {})  # what the converter wrote: absent in hand-made directories
    if not isinstance(section, dict):
        bad("mlx_dgemma", "an object (written by mlx-dgemma convert)", section)
    weights = section.get("weights", "exact")
    if not (isinstance(weights, str) and weights in STORED_FORMS):
        bad("mlx_dgemma.weights", f"one of {', '.join(TIERS)} (the precision it was converted in)", weights)
    q = config.get("quantization", {})
    if not isinstance(q, dict):
        bad("quantization", "an object", q)
    quantized = formats.names(lambda t: t.quantized)
    for k, v in q.items():
        if k in ("group_size", "bits"):
            if not (is_int(v) and (v in _BITS if k == "bits" else v in (32, 64, 128))):
                bad(f"quantization.{k}", "bits in {2,3,4,5,6,8}" if k == "bits" else "32, 64 or 128", v)
        elif isinstance(v, dict):
            if not (is_int(v.get("bits")) and v["bits"] in _BITS and v.get("group_size", 32) in (32, 64, 128)
                    and v.get("subblock", 32) in (16, 32)):
                bad(f"quantization[{k!r}]", "bits in {2,3,4,5,6,8}, group_size 32/64/128, subblock 16/32", v)
            # the type the weight came from: the memory plan prices and fast re-quantizes by it
            if v.get("ggml_type") is not None and v["ggml_type"] not in quantized:
                bad(f"quantization[{k!r}].ggml_type", f"one of {', '.join(quantized)}", v["ggml_type"])


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
        ok = isinstance(e, dict) and e.get("dtype") in SAFETENSORS_DTYPES and isinstance(e.get("shape"), list) \
            and all(is_int(d) and 0 <= d < 1 << 40 for d in e["shape"]) and len(e["shape"]) <= 8 \
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 \
            and all(is_int(x) for x in e["data_offsets"])
        if not ok:
            raise ModelFilesError(f"{path}: tensor {name!r} has a malformed header entry {short_repr(e)}; convert "
                                  "the model again")
        a, b = e["data_offsets"]
        if not 0 <= a <= b <= data:
            raise ModelFilesError(f"{path}: tensor {name!r} lies at bytes {a}..{b}, outside the data section "
                                  f"({data} bytes); the file is truncated or corrupt, convert again")
        need = math.prod(e["shape"]) * SAFETENSORS_DTYPES[e["dtype"]].itemsize
        if b - a != need:
            raise ModelFilesError(f"{path}: tensor {name!r} has {b - a} bytes but shape {e['shape']} of "
                                  f"{e['dtype']} needs {need}; convert again")
        spans.append((a, b, name))
    spans.sort()
    for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
        if b0 > a1:
            raise ModelFilesError(f"{path}: tensors {n0!r} and {n1!r} overlap; convert the model again")
    return entries


def model_dir_shards(path: Path) -> list[Path]:
    """The shard files of a converted directory (the index's, which must match the directory)."""
    index = path / "model.safetensors.index.json"
    # fast's sidecar (mlx_dgemma.sidecar) is derived from the shards, not one of them
    present = sorted(p.name for p in path.glob("*.safetensors") if p.name != SIDECAR_FILE)
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
            ggufs = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else []
            if ggufs:  # a download folder: the model is the file in it
                raise ModelFilesError(f"{path}: not a converted directory ({name} is missing), but it holds "
                                      f"{', '.join(ggufs[:3])}; give that file: {path / ggufs[0]}")
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
