"""Precisions as weight recipes, the one re-quantizer, and the bytes each precision takes.

Plain data and NumPy only (no MLX import): ``convert --precision`` writes a tier without MLX,
the runtime (:mod:`mlx_dgemma.precision`) applies the same recipe to loaded weights through the
same :func:`requantize`, and the memory plan (:mod:`mlx_dgemma.plan`) prices a precision from
the tensor inventory before a byte of weights is read.

Precisions, most exact first:

* ``exact``: every weight as the GGUF stores it (bit-exact; float32 K-quant scales, padded
  16-element sub-blocks).
* ``fast``: the exact integers with scales in the activation dtype; padded sub-block types
  (Q2_K, Q3_K, Q6_K) re-quantized to 8-bit groups of 32. On disk (``convert --precision fast``,
  formerly ``--compact``) the scales are float16.
* ``q4`` (fits a 24 GB Mac: 14.2 GB of weights at full size): experts 4-bit, the embedding
  (also the output head and the self-conditioning matrix) 6-bit, everything else (attention,
  dense MLP, self-conditioning MLP) 5-bit.
* ``q3`` (aimed at a 16 GB Mac: 11.3 GB): experts 3-bit, except the first and last layers'
  4-bit; the embedding 6-bit, everything else 4-bit. Under 10 GB would take 2-bit experts.

Groups: 128 for the experts, 64 elsewhere; a group that does not divide a row falls back to the
next smaller (the published down projections, 704 and 2112 wide, use 64).

Why these: on real llama.cpp blocks (``benchmarks/tier_recipes.py``) affine 4-bit groups of 128
(4.25 bits per weight) give 15 % less error than ``mxfp4`` at the same 4.25 bits, and the bytes
go where they are used on every token (attention, dense MLP, head) rather than to the 128
experts of which 8 are used.

A re-quantized weight is MLX affine (``w = scale * q + bias`` per group, float16 scale and
bias) computed by :func:`requantize` from the exact float32 values: min-max ranges refined by a
least-squares refit of each group's scale and bias (lower RMS error than min-max alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .schema import unpad_subblocks

# Most exact first: ``auto`` picks the first that fits.
TIERS = ("exact", "fast", "q4", "q3")
PRECISIONS = ("auto", *TIERS)
LOSSY_ON_DISK = ("fast", "q4", "q3")  # what ``convert --precision`` can write besides exact

# One line each, for --help, plan and README.
TIER_RECIPE = {  # what each precision stores, for any model (a conversion's summary says this)
    "exact": "bit-exact weights, float32 (verify's and the parity tests' form)",
    "fast": "exact integers, half-precision scales, Q6_K head re-quantized to 8 bits",
    "q4": "experts 4-bit, the rest 5-6 bits",
    "q3": "experts 3-bit, the rest 4-6 bits",
}
# the published model at full size (README, "Which Mac, which form, which command"): --help adds it
FULL_SIZE_NOTE = {"q4": " (14.2 GB at full size): fits a 24 GB Mac",
                  "q3": " (11.3 GB at full size): a 16 GB Mac with its GPU limit raised"}
TIER_HELP = {k: v + FULL_SIZE_NOTE.get(k, "") for k, v in TIER_RECIPE.items()}

# Padded sub-block types (Q2_K, Q3_K, Q6_K) in fast: 8 bits keeps their 6-bit (or fewer) values
# to within a fraction of their own step; 32 is MLX's smallest affine group.
FAST_BITS, FAST_GROUP = 8, 32
PADDED_TYPES = ("Q2_K", "Q3_K", "Q6_K")
SCALE_DTYPE = np.float16  # scales and biases of every re-quantized weight, on disk and in memory


def check_precision_dtype(precision: str, dtype: str | None) -> None:
    """``exact`` is float32 by definition: another activation dtype with it is an error rather
    than a silent contradiction. By name, standard library only, so the command line refuses
    ``--precision exact --dtype bfloat16`` before it imports MLX (it took 7.8 s to say so)."""
    if precision == "exact" and dtype is not None and dtype != "float32":
        from .errors import ParameterError

        raise ParameterError("--dtype: exact precision runs in float32; use --precision fast "
                             "for bfloat16/float16 activations")


# config.json's ``mlx_dgemma.weights``: a tier, or "compact" (fast's form under its older name)
STORED_FORMS = (*TIERS, "compact")


def stored_precision(config: dict) -> str:
    """The form a converted directory's weights are in (config.json ``mlx_dgemma.weights``,
    exact where the section or the key is absent; "compact", the older name of fast's form,
    reads as "fast"). ValueError for any other value: ``validate.check_config`` refuses those
    first, naming the file; read as exact, a lossy directory would be taken for bit-exact."""
    section = config.get("mlx_dgemma", {})
    w = section.get("weights", "exact") if isinstance(section, dict) else None
    if not (isinstance(w, str) and w in STORED_FORMS):
        raise ValueError(f"config.json mlx_dgemma.weights = {w!r}: expected one of {', '.join(TIERS)}")
    return "fast" if w == "compact" else w


@dataclass(frozen=True)
class Target:
    """What one weight becomes: ``bits``-bit affine groups of ``group_size`` (float16 scales)."""

    bits: int
    group_size: int


_LAYER = re.compile(r"^layers\.(\d+)\.")


def target(precision: str, module: str, ggml_type: str, num_layers: int, width: int) -> Target | None:
    """The re-quantization target of the weight of ``module`` (an MLX module path such as
    ``layers.3.experts.gate_up_proj``) stored as ``ggml_type`` with rows of ``width`` elements,
    or None: kept as stored (``exact`` keeps everything; ``fast`` keeps all but the padded
    sub-block types). A group that does not divide the row falls back to the next smaller one
    (the published down projections are 704 and 2112 wide: groups of 64)."""
    goal = _recipe(precision, module, ggml_type, num_layers)
    if goal is None:
        return None
    group = next((g for g in (128, 64, 32) if g <= goal.group_size and width % g == 0), None)
    return None if group is None else Target(goal.bits, group)


def _recipe(precision: str, module: str, ggml_type: str, num_layers: int) -> Target | None:
    if precision in ("exact", "auto"):
        return None
    if precision == "fast":
        return Target(FAST_BITS, FAST_GROUP) if ggml_type in PADDED_TYPES else None
    if precision not in ("q4", "q3"):
        raise ValueError(f"unknown precision {precision!r}")
    if ".experts." in module:
        m = _LAYER.match(module)
        edge = m is not None and int(m.group(1)) in (0, num_layers - 1)
        return Target(4 if precision == "q4" or edge else 3, 128)
    if module == "embed_tokens":  # the output head and the self-conditioning matrix
        return Target(6, 64)
    return Target(5 if precision == "q4" else 4, 64)


# --------------------------------------------------------------------------------------------
# the re-quantizer


def quantize_affine(w: np.ndarray, bits: int, group_size: int, refits: int = 2
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows ``[..., n]`` -> (q uint8 ``[..., n]``, scales, biases ``[..., n/group]`` float16).

    Min-max range per group, then ``refits`` rounds of: round to the grid, and refit scale and
    bias by least squares to the rounded integers (each round can only lower the group's
    squared error for the chosen integers). Scales and biases are rounded to float16 *before*
    the integers are chosen, so the stored triple dequantizes to what was measured. Groups
    whose scale or bias overflows float16 raise ``OverflowError`` (the caller names the tensor).
    """
    levels = (1 << bits) - 1
    g = np.asarray(w, dtype=np.float32).reshape(*w.shape[:-1], -1, group_size)
    lo, hi = g.min(-1), g.max(-1)
    scale, bias = _half((hi - lo) / levels), _half(lo)
    q = _round_to_grid(g, scale, bias, levels)
    for _ in range(refits):
        qf = q.astype(np.float32)
        n = group_size
        sq, sw = qf.sum(-1), g.sum(-1)
        sqq, sqw = (qf * qf).sum(-1), (qf * g).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = np.where(ok, det, 1)
        new_s = np.where(ok, (n * sqw - sq * sw) / safe, scale)
        new_b = np.where(ok, (sw - new_s * sq) / n, bias)
        scale, bias = _half(new_s), _half(new_b)
        q = _round_to_grid(g, scale, bias, levels)
    return q.reshape(w.shape), scale, bias


def _half(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = x.astype(SCALE_DTYPE)
    if not np.isfinite(h).all():
        raise OverflowError(f"a group's scale or offset exceeds float16's range (max |value| "
                            f"{float(np.abs(x).max()):.3g})")
    return h


def _round_to_grid(g: np.ndarray, scale: np.ndarray, bias: np.ndarray, levels: int) -> np.ndarray:
    s = scale.astype(np.float32)[..., None]
    safe = np.where(s == 0, 1, s)
    return np.clip(np.rint((g - bias.astype(np.float32)[..., None]) / safe), 0, levels).astype(np.uint8)


def dequantize(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int) -> np.ndarray:
    """Inverse of :func:`quantize_affine` (unpacked integers), float32."""
    g = q.reshape(*q.shape[:-1], -1, group_size).astype(np.float32)
    w = g * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(q.shape)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``q`` ([..., n] uint8, n*bits % 32 == 0) into MLX's uint32 layout.

    MLX reads each row as an LSB-first bitstream: element j occupies bits
    [j*bits, (j+1)*bits) of the row's little-endian byte string.
    """
    per = {1: 8, 2: 4, 3: 8, 4: 2, 5: 8, 6: 4, 8: 1}[bits]  # elements per whole-byte chunk
    nbytes = per * bits // 8
    lead, n = q.shape[:-1], q.shape[-1]
    chunks = q.reshape(*lead, n // per, per).astype(np.uint64)
    acc = np.zeros(chunks.shape[:-1], dtype=np.uint64)
    for i in range(per):
        acc |= chunks[..., i] << np.uint64(bits * i)
    raw = acc.view(np.uint8).reshape(*acc.shape, 8)[..., :nbytes]
    return np.ascontiguousarray(raw).reshape(*lead, n * bits // 8).view(np.uint32)


def unpack_bits(w: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`."""
    raw = np.ascontiguousarray(w).view(np.uint8)
    b = np.unpackbits(raw, axis=-1, bitorder="little")
    b = b.reshape(*raw.shape[:-1], -1, bits)
    return (b.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint8)


@dataclass(frozen=True)
class Requantized:
    """A re-quantized weight in MLX's stored form, and how far it is from the exact values."""

    weight: np.ndarray  # uint32, packed
    scales: np.ndarray  # float16
    biases: np.ndarray  # float16
    max_abs_error: float
    sq_error: float  # sum of squared errors (relative RMS = sqrt(sq_error / sq_exact))
    sq_exact: float


def requantize(w: np.ndarray, t: Target) -> Requantized:
    """Exact float32 rows ``[..., n]`` (sub-block padding already removed) -> ``t``'s stored form.

    The one re-quantizer: ``convert --precision`` and the runtime precisions (``fast``, the
    tiers) both call it, so a tier loaded from a GGUF, from an exact directory or from its own
    converted directory holds the same numbers.
    """
    q, s, b = quantize_affine(w, t.bits, t.group_size)
    diff = dequantize(q, s, b, t.group_size) - w
    return Requantized(pack_bits(q, t.bits), s, b, float(np.abs(diff).max(initial=0.0)),
                       float(np.square(diff, dtype=np.float64).sum()),
                       float(np.square(w, dtype=np.float64).sum()))


def dequantize_stored(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                      group_size: int = 32, subblock: int = 32) -> np.ndarray:
    """A stored (packed, possibly padded) affine weight -> float32 values, padding dropped."""
    q = unpack_bits(weight, bits)
    return unpad_subblocks(dequantize(q, scales, biases, group_size), subblock)


# --------------------------------------------------------------------------------------------
# bytes of a precision, from the tensor inventory alone


@dataclass(frozen=True)
class TensorInfo:
    """One weight of the inventory: MLX module path (parameter path for float tensors), logical
    shape in MLX order (last axis = row), ggml type as stored in the GGUF."""

    module: str
    shape: tuple[int, ...]
    ggml_type: str


# bits per element of each ggml type's exact MLX form, and whether its scales stay float32
_EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4,
               "Q5_K": 5, "Q6_K": 6}
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# K-quant scales (d * sc) are not exact in float16; the legacy types' are (schema: narrowest exact)
_FLOAT32_SCALES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def tensor_bytes(info: TensorInfo, precision: str, num_layers: int, scale_bytes: int = 2,
                 float_bytes: int | None = None) -> int:
    """Bytes ``precision`` holds for one weight. ``scale_bytes``: the itemsize of fast's scales
    (2 on a GPU, 4 on MLX's CPU backend, 2 on disk); ``float_bytes``: the itemsize float tensors
    are held in (None: as stored)."""
    n = int(np.prod(info.shape))
    if info.ggml_type in _FLOAT_BYTES:
        return n * (float_bytes or _FLOAT_BYTES[info.ggml_type])
    t = target(precision, info.module, info.ggml_type, num_layers, info.shape[-1])
    if t is not None:
        return n * t.bits // 8 + 2 * (n // t.group_size) * np.dtype(SCALE_DTYPE).itemsize
    bits = _EXACT_BITS[info.ggml_type]
    padded = info.ggml_type in PADDED_TYPES
    stored = n * (2 if padded else 1)
    if precision == "exact":
        sb = 4 if info.ggml_type in _FLOAT32_SCALES else 2
    else:
        sb = scale_bytes
    return stored * bits // 8 + 2 * (stored // 32) * sb


def weight_bytes(inventory: Iterable[TensorInfo], precision: str, num_layers: int, scale_bytes: int = 2,
                 float_bytes: int | None = None) -> int:
    """Bytes of all weights in ``precision`` (see :func:`tensor_bytes`)."""
    return sum(tensor_bytes(i, precision, num_layers, scale_bytes, float_bytes) for i in inventory)
