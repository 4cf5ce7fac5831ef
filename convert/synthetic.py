"""Tiny random DiffusionGemma GGUFs in the published file's format (tests, demo, benchmarks).

The writer uses gguf-py's ``GGUFWriter`` with the published metadata keys and tensor names.
Quantized tensors are valid random ggml blocks whose ``d``/``dmin`` fields are set so the
dequantized weights have a chosen standard deviation and zero mean; norms, router and
scales are float32 and *well conditioned* (see ../shared/reference/README.md): random
tiny models with unit norm weights amplify float32 rounding hundreds of times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.formats import TYPES
from mlx_dgemma.schema import ModelArgs

from .metadata import ARCH, args_from_metadata
from .names import expected_tensors, q4_k_m_types
from .quants import FLOAT_TYPES, FORMATS, supported_types


@dataclass
class TinySpec:
    """Shape of a synthetic model. Defaults: small, but every code path is exercised."""

    hidden_size: int = 256
    intermediate_size: int = 256
    num_layers: int = 3
    global_layers: tuple[int, ...] = (2,)
    num_heads: int = 2
    num_kv_heads: int = 1
    num_global_kv_heads: int = 1
    head_dim: int = 64
    global_head_dim: int = 128
    sliding_window: int = 16
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    vocab_size: int = 512
    canvas_length: int = 32
    context_length: int = 4096
    rope_theta: float = 1e6
    rope_theta_swa: float = 1e4
    partial_rotary: float = 0.25
    eps: float = 1e-6
    softcap: float = 30.0
    extra_metadata: dict = field(default_factory=dict)

    def text_config(self) -> ModelArgs:
        return args_from_metadata(self.metadata(), self.vocab_size, partial_rotary_factor=self.partial_rotary)

    def metadata(self) -> dict:
        pattern = [i not in self.global_layers for i in range(self.num_layers)]
        kv = [self.num_kv_heads if s else self.num_global_kv_heads for s in pattern]
        p = ARCH + "."
        md = {
            "general.architecture": ARCH, "general.type": "model", "general.name": "tiny-random",
            "general.quantization_version": 2, "general.file_type": 15,
            p + "block_count": self.num_layers, p + "context_length": self.context_length,
            p + "embedding_length": self.hidden_size, p + "feed_forward_length": self.intermediate_size,
            p + "attention.head_count": self.num_heads, p + "attention.head_count_kv": kv,
            p + "rope.freq_base": self.rope_theta, p + "rope.freq_base_swa": self.rope_theta_swa,
            p + "attention.layer_norm_rms_epsilon": self.eps, p + "expert_count": self.num_experts,
            p + "expert_used_count": self.top_k, p + "attention.key_length": self.global_head_dim,
            p + "attention.value_length": self.global_head_dim,
            p + "final_logit_softcapping": self.softcap,
            p + "attention.sliding_window": self.sliding_window,
            p + "attention.shared_kv_layers": 0, p + "embedding_length_per_layer_input": 0,
            p + "attention.sliding_window_pattern": pattern,
            p + "attention.key_length_swa": self.head_dim, p + "attention.value_length_swa": self.head_dim,
            p + "expert_feed_forward_length": self.moe_intermediate_size,
            p + "rope.dimension_count": self.global_head_dim, p + "rope.dimension_count_swa": self.head_dim,
            p + "attention.causal": False, "diffusion.canvas_length": self.canvas_length,
        }
        md.update(self.extra_metadata)
        return md


def random_blocks(qtype: T, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid random ggml blocks ([rows, bytes] uint8) whose values have ~``std`` and mean ~0."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if qtype not in FORMATS:  # a type we cannot convert: only error tests write these
        return raw.reshape(rows, cols // block * size)
    d_off, m_off, m_mult = FORMATS[qtype].fp16_fields

    def set_fields(d: np.ndarray) -> None:
        raw[:, d_off:d_off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        if m_off is not None:
            raw[:, m_off:m_off + 2] = (d * m_mult).astype(np.float16).view(np.uint8).reshape(nb, 2)

    # Jitter d per block so blocks differ in scale, then rescale to the target std
    # (calibrated on a sample of blocks: GB-sized tensors are never dequantized whole).
    jitter = rng.uniform(0.5, 1.5, nb).astype(np.float32)
    set_fields(jitter)
    unit = float(gguf_dequantize(raw[:4096], qtype).std())
    set_fields(jitter * (std / unit))
    return raw.reshape(rows, cols // block * size)


# Float tensors: (mean, std) of well-conditioned random values by tensor kind.
def _float_tensor(kind: str, ne: tuple[int, ...], partial_rotary: float, rng: np.random.Generator,
                  scalars: dict[str, float]) -> np.ndarray:
    shape = tuple(reversed(ne))
    if kind in ("attn_q_norm", "attn_k_norm"):
        # q/k norms set the attention logit scale (attention scale is 1.0): std ~2 scores.
        hd = ne[0]
        return rng.normal(1.0, 0.2, shape).astype(np.float32) * (2.0 / hd**0.25)
    if kind == "output_norm":
        return rng.normal(1.0, 0.1, shape).astype(np.float32) * 8.0
    if kind == "rope_freqs":
        f = np.full(shape, 1e30, np.float32)
        f[: int(partial_rotary * ne[0])] = 1.0
        return f
    if kind in ("layer_output_scale", "enc_layer_output_scale"):
        return np.full(shape, scalars[kind], np.float32)
    if kind == "ffn_gate_inp":
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    if kind == "ffn_gate_inp.scale" or kind == "ffn_down_exps.scale":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    # RMSNorm weights (stored without the +1 offset)
    return rng.uniform(0.6, 1.4, shape).astype(np.float32)


def _kind(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    if parts[-1] == "scale":
        return ".".join(parts)
    return ".".join(parts[:-1])


def plan_types(cfg: ModelArgs, plan: str | dict[str, T]) -> dict[str, T]:
    """Per-tensor ggml types: 'q4_k_m' (llama.cpp's recipe), 'f32', 'f16', 'all' (cycle every
    supported type but F32 over the matrices, in mlx_dgemma.formats' order) or an explicit
    {name: type} map."""
    exp = expected_tensors(cfg)
    if isinstance(plan, dict):
        base = {e.name: T.F32 for e in exp}
        base.update(plan)
        return base
    if plan == "q4_k_m":
        return q4_k_m_types(exp)
    if plan in ("f32", "f16"):
        ft = T.F32 if plan == "f32" else T.F16
        return {e.name: (ft if e.matrix else T.F32) for e in exp}
    if plan == "all":
        supported = supported_types()
        cycle = [T[n] for n in TYPES if n != "F32" and T[n] in supported]
        out, k = {}, 0
        for e in exp:
            if not e.matrix:
                out[e.name] = T.F32
                continue
            for _ in range(len(cycle)):
                t = cycle[k % len(cycle)]
                k += 1
                if e.ne[0] % GGML_QUANT_SIZES[t][0] == 0:
                    break
            out[e.name] = t
        return out
    raise ValueError(f"unknown type plan {plan!r}")


def tiny_tokenizer_metadata(vocab_size: int) -> dict:
    """A small gemma4-style BPE vocabulary with the Gemma 4 special tokens at their ids."""
    from .tokenizer_data import synthetic_gemma4_vocab  # noqa: PLC0415

    return synthetic_gemma4_vocab(vocab_size)


def write_tiny_gguf(path: str | Path, spec: TinySpec | None = None, *, types: str | dict = "q4_k_m",
                    seed: int = 0, weight_std: float = 0.05, chat_template: str | None = None,
                    encoder_scalar: float = 0.8, decoder_scalar: float = 1.25,
                    tokenizer: dict | None = None, drop: tuple[str, ...] = (),
                    extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a random DiffusionGemma GGUF; returns ``path``.

    Encoder and decoder layer scalars differ on purpose (a mix-up then shows in parity tests).
    ``drop`` and ``extra_tensors`` build deliberately broken files for error tests.
    """
    spec = spec or TinySpec()
    cfg = spec.text_config()
    qtypes = plan_types(cfg, types)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), ARCH)
    md = spec.metadata()
    for k, v in md.items():
        if k == "general.architecture":
            continue
        _add_kv(w, k, v)
    tok = tokenizer if tokenizer is not None else tiny_tokenizer_metadata(spec.vocab_size)
    for k, v in tok.items():
        _add_kv(w, k, v)
    if chat_template is not None:
        w.add_string("tokenizer.chat_template", chat_template)
    scalars = {"layer_output_scale": decoder_scalar, "enc_layer_output_scale": encoder_scalar}
    for e in expected_tensors(cfg):
        if e.name in drop:
            continue
        data, raw_dtype = random_tensor(e.name, e.ne, qtypes[e.name], e.matrix, rng, weight_std=weight_std,
                                        partial_rotary=spec.partial_rotary, scalars=scalars)
        w.add_tensor(e.name, data, raw_dtype=raw_dtype)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def random_tensor(name: str, ne: tuple[int, ...] | list[int], qtype: T, matrix: bool, rng: np.random.Generator,
                  *, weight_std: float = 0.05, partial_rotary: float = 0.25,
                  scalars: dict[str, float] | None = None) -> tuple[np.ndarray, T | None]:
    """One tensor's data as a GGUF writer takes it: (array, ``raw_dtype`` or None).

    ``ne`` is the GGUF shape (fastest axis first). Matrices get valid random ``qtype`` blocks
    (or dense values) of standard deviation ``weight_std``; the other tensors (norms, router,
    scales, RoPE factors) the well-conditioned float32 values of their kind. ``scalars`` sets the
    decoder/encoder layer scalars (default 1.25 / 0.8, different on purpose).
    """
    ne = tuple(int(x) for x in ne)
    scalars = scalars or {"layer_output_scale": 1.25, "enc_layer_output_scale": 0.8}
    if not matrix:
        return _float_tensor(_kind(name), ne, partial_rotary, rng, scalars), None
    if qtype in FLOAT_TYPES:
        dense = rng.normal(0.0, weight_std, tuple(reversed(ne))).astype(np.float32)
        if qtype == T.BF16:
            bits = (dense.view(np.uint32) >> 16).astype(np.uint16)
            return bits.view(np.uint8).reshape(*dense.shape[:-1], -1), T.BF16
        return dense.astype(np.float16 if qtype == T.F16 else np.float32), None
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    raw = random_blocks(qtype, rows, ne[0], weight_std, rng)
    return raw.reshape(*reversed(ne[1:]), -1), qtype


def add_metadata(w: GGUFWriter, key: str, value) -> None:
    """Add one metadata value with the type gguf-py's writer gives it (bool, uint32, float32,
    string, array)."""
    _add_kv(w, key, value)


def _add_kv(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:  # pragma: no cover
        raise TypeError(f"unsupported metadata value for {key}: {type(value)}")
