"""Exact repacking of ggml block formats into MLX affine quantization.

MLX affine quantization stores, per group of ``group_size`` consecutive elements of a row,
``w = scale * q + bias`` with ``q`` an unsigned ``bits``-bit integer. Every ggml type below
is rewritten into that form *without changing a single dequantized value*:

* the integer ``q`` of each element is recovered from the block's packed fields;
* the per-group ``scale`` and ``bias`` are the float32 products ggml itself forms
  (``d * sc``, ``-dmin * m``, ``-8 * d`` ...). They are exact in float32; the writer stores
  them as float16 only where that is exact too (see :func:`narrowest_exact_dtype`);
* ``q * scale`` is exact in float32 for every type (at most 24 significant bits), so MLX's
  ``q * scale + bias`` rounds once, exactly where ggml's ``d * q - dm`` does.

Types with 16-element sub-blocks (Q2_K, Q3_K, Q6_K) cannot be one MLX group (the smallest
group is 32). They use the *padded* layout: each 16-element sub-block becomes a 32-element
group whose last 16 entries are padding (q = 0) that multiplies zeros inserted into the
input (see :func:`mlx_dgemma.schema.pad_subblocks`). The padding doubles the stored row width.

Each class splits a block's bytes in struct order (the field order of ggml's ``block_*``
structs), mirroring gguf-py's dequantizers so a reader can check one against the other. A class
registers itself for its type (``qtype=``, as gguf-py's quant classes do) and reads the type's
bits and sub-block width from its row in :data:`mlx_dgemma.formats.TYPES`: a new type is that
row and its class here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K as _GGUF_Q4_K

from mlx_dgemma.formats import TYPES  # each type's facts, declared once for core and converter
from mlx_dgemma.schema import pad_subblocks, unpad_subblocks  # the layout both sides share
from mlx_dgemma.tiers import pack_bits, unpack_bits  # MLX's bit layout, shared with the re-quantizer

QK_K = 256


@dataclass(frozen=True)
class Split:
    """A run of blocks decoded to MLX affine form (float32 scales and biases).

    q:      [n_blocks, block_size] uint8, values in [0, 2**bits)
    scales: [n_blocks, block_size // subblock] float32
    biases: [n_blocks, block_size // subblock] float32
    """

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two raw bytes per row -> float32 column [n, 1]."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n_blocks: int, width: int) -> np.ndarray:
    """Bytes holding element j in the low nibble and element j + width in the high nibble."""
    q = qs.reshape(n_blocks, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n_blocks, -1)


def _bits_of(mask: np.ndarray, n_blocks: int, n: int) -> np.ndarray:
    """Little-endian bit unpacking: element j is bit j of the byte string."""
    return np.unpackbits(mask, axis=-1, bitorder="little")[:, :n].reshape(n_blocks, n)


# every block class, by its type: filled as the classes below are declared (BlockFormat)
FORMATS: dict[T, type[BlockFormat]] = {}


class BlockFormat:
    """One ggml block type, split into MLX affine fields. A subclass names its type
    (``class Q4_0(BlockFormat, qtype=T.Q4_0)``) and is registered in :data:`FORMATS`; its
    ``bits`` and ``subblock`` are its row's in :data:`mlx_dgemma.formats.TYPES`."""

    qtype: ClassVar[T]
    bits: ClassVar[int]  # of its exact MLX form
    subblock: ClassVar[int]  # elements sharing one scale/bias; 16 means padded groups
    # the synthetic writer's float16 fields (convert/synthetic.py): byte offsets of ``d`` and of
    # the second field (``dmin`` or ``m``; None without one), and the multiple of ``d`` written
    # to that second field that centres the values on zero for uniform random q and sub-scales
    fp16_fields: ClassVar[tuple[int, int | None, float]]

    def __init_subclass__(cls, qtype: T, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        row = TYPES.get(qtype.name)
        if row is None or not row.quantized:
            raise TypeError(f"{cls.__name__}: {qtype.name} needs its quantized row in mlx_dgemma.formats.TYPES")
        if qtype in FORMATS:
            raise TypeError(f"{cls.__name__}: {qtype.name} already has its class, {FORMATS[qtype].__name__}")
        if cls.split.__func__ is BlockFormat.split.__func__ or not hasattr(cls, "fp16_fields"):
            raise TypeError(f"{cls.__name__}: a block class defines split() and fp16_fields")
        cls.qtype, cls.bits, cls.subblock = qtype, row.bits, row.subblock
        FORMATS[qtype] = cls

    @classmethod
    def block_size(cls) -> int:
        return GGML_QUANT_SIZES[cls.qtype][0]

    @classmethod
    def type_size(cls) -> int:
        return GGML_QUANT_SIZES[cls.qtype][1]

    @classmethod
    def split(cls, blocks: np.ndarray) -> Split:
        """Decode ``blocks`` ([n_blocks, type_size] uint8) into q, scales and biases."""
        raise NotImplementedError


class Q4_0(BlockFormat, qtype=T.Q4_0):
    """block_q4_0 { f16 d; u8 qs[16]; }  w = d * (q - 8)"""

    fp16_fields = (0, None, 0)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, qs = np.hsplit(blocks, [2])
        d = _f16(d)
        return Split(_nibbles(qs, n, 16), d, -8 * d)


class Q4_1(BlockFormat, qtype=T.Q4_1):
    """block_q4_1 { f16 d; f16 m; u8 qs[16]; }  w = d * q + m"""

    fp16_fields = (0, 2, -7.5)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, m, qs = np.hsplit(blocks, [2, 4])
        return Split(_nibbles(qs, n, 16), _f16(d), _f16(m))


class Q5_0(BlockFormat, qtype=T.Q5_0):
    """block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }  w = d * (q - 16)

    qh: bit j is bit 4 of element j; qs: low nibbles as in Q4_0.
    """

    fp16_fields = (0, None, 0)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, qh, qs = np.hsplit(blocks, [2, 6])
        d = _f16(d)
        q = _nibbles(qs, n, 16) | (_bits_of(qh, n, 32) << np.uint8(4))
        return Split(q, d, -16 * d)


class Q5_1(BlockFormat, qtype=T.Q5_1):
    """block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }  w = d * q + m"""

    fp16_fields = (0, 2, -15.5)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, m, qh, qs = np.hsplit(blocks, [2, 4, 8])
        q = _nibbles(qs, n, 16) | (_bits_of(qh, n, 32) << np.uint8(4))
        return Split(q, _f16(d), _f16(m))


class Q8_0(BlockFormat, qtype=T.Q8_0):
    """block_q8_0 { f16 d; i8 qs[32]; }  w = d * qs, stored as (qs + 128) with bias -128 d"""

    fp16_fields = (0, None, 0)

    @classmethod
    def split(cls, blocks):
        d, qs = np.hsplit(blocks, [2])
        d = _f16(d)
        q = (qs.copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Split(q, d, -128 * d)


class Q2_K(BlockFormat, qtype=T.Q2_K):
    """block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }  w = d*sc*q - dmin*m

    scales[k]: low nibble sc, high nibble m of sub-block k (16 elements).
    qs: two halves of 32 bytes; bits 2i..2i+1 of byte l hold element (half*4 + i)*32 + l.
    """

    fp16_fields = (80, 82, 1.5)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        scales, qs, d, dmin = np.hsplit(blocks, [16, 80, 82])
        d, dmin = _f16(d), _f16(dmin)
        shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((qs.reshape(n, 2, 1, 32) >> shift) & np.uint8(3)).reshape(n, QK_K)
        sc = (scales & np.uint8(0x0F)).astype(np.float32)
        m = (scales >> np.uint8(4)).astype(np.float32)
        return Split(q, d * sc, -(dmin * m))


class Q3_K(BlockFormat, qtype=T.Q3_K):
    """block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }  w = d*(sc-32)*(q-4)

    q = low 2 bits from qs (Q2_K layout) + 4 * hmask bit; the 6-bit sc of 16 sub-blocks are
    packed as low nibbles in scales[0:8] and high 2-bit pairs in scales[8:12] (see gguf-py).
    """

    fp16_fields = (108, None, 0)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        hmask, qs, scales, d = np.hsplit(blocks, [32, 96, 108])
        d = _f16(d)
        lo, hi = np.hsplit(scales, [8])
        lo = (lo.reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
        hi = (hi.reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
        sc = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))).astype(np.float32) - 32
        shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        ql = ((qs.reshape(n, 2, 1, 32) >> shift) & np.uint8(3)).reshape(n, QK_K)
        qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
        q = ql | (qh.reshape(n, QK_K) << np.uint8(2))  # ggml: ql - 4 * (1 - h) == (ql + 4h) - 4
        scale = d * sc
        return Split(q, scale, -4 * scale)


class Q4_K(BlockFormat, qtype=T.Q4_K):
    """block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }  w = d*sc*q - dmin*m

    scales: 8 (sc, m) pairs of 6 bits (ggml get_scale_min_k4); qs: 4 chunks of 32 bytes,
    low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
    """

    fp16_fields = (0, 2, 7.5)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, dmin, scales, qs = np.hsplit(blocks, [2, 4, 16])
        sc, m = _GGUF_Q4_K.get_scale_min(scales)
        return Split(_nibbles(qs, n, 32), _f16(d) * sc.reshape(n, 8).astype(np.float32),
                     -(_f16(dmin) * m.reshape(n, 8).astype(np.float32)))


class Q5_K(BlockFormat, qtype=T.Q5_K):
    """block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }

    As Q4_K, plus bit 4 of element 32*c + l in bit c of qh[l].
    """

    fp16_fields = (0, 2, 15.5)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        d, dmin, scales, qh, qs = np.hsplit(blocks, [2, 4, 16, 48])
        sc, m = _GGUF_Q4_K.get_scale_min(scales)
        high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
        q = _nibbles(qs, n, 32) | (high.reshape(n, QK_K) << np.uint8(4))
        return Split(q, _f16(d) * sc.reshape(n, 8).astype(np.float32),
                     -(_f16(dmin) * m.reshape(n, 8).astype(np.float32)))


class Q6_K(BlockFormat, qtype=T.Q6_K):
    """block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }  w = d*sc*(q - 32)

    ql: two halves of 64 bytes with nibbles as in Q4_K; qh: 2-bit pairs for the 4 quarters
    of each 128-element half.
    """

    fp16_fields = (208, None, 0)

    @classmethod
    def split(cls, blocks):
        n = blocks.shape[0]
        ql, qh, scales, d = np.hsplit(blocks, [128, 192, 208])
        lo = _nibbles(ql, n, 64).reshape(n, 2, 128)
        hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
        hi = (hi & np.uint8(3)).reshape(n, 2, 128)
        q = (lo | (hi << np.uint8(4))).reshape(n, QK_K)
        scale = _f16(d) * scales.copy().view(np.int8).astype(np.float32)
        return Split(q, scale, -32 * scale)


# the float types' NumPy types, by the bytes of their rows (BF16: None, kept as raw uint16)
FLOAT_TYPES: dict[T, type | None] = {T[t.name]: None if t.name == "BF16" else np.dtype(f"<f{t.float_bytes}").type
                                     for t in TYPES.values() if not t.quantized}


def supported_types() -> list[T]:
    """The types the converter reads: the float types and every type with a block class
    (a quantized row without one is refused by name), in ggml's order."""
    return sorted([*FORMATS, *FLOAT_TYPES], key=lambda t: t.value)


def narrowest_exact_dtype(*arrays: np.ndarray, chunk: int = 1 << 20) -> type:
    """float16 when every value survives a float16 round trip, else float32 (checked in
    slices, so no full-size temporaries)."""
    for a in arrays:
        flat = a.reshape(-1)
        for i in range(0, flat.size, chunk):
            part = flat[i:i + chunk]
            with np.errstate(over="ignore"):
                if not np.array_equal(part.astype(np.float16).astype(np.float32), part):
                    return np.float32
    return np.float16


@dataclass(frozen=True)
class Affine:
    """Rows repacked for MLX: ``weight`` uint32, ``scales``/``biases`` per 32-element group."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray


def repack_rows(raw: np.ndarray, qtype: T, scale_dtype: type | None = None) -> Affine:
    """Repack ``raw`` ([rows, bytes_per_row] uint8 of ggml blocks) into MLX affine arrays.

    ``scale_dtype`` None keeps float32 scales; the caller decides whether float16 is exact.
    """
    fmt = FORMATS[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, fmt.type_size())
    s = fmt.split(blocks)
    q = pad_subblocks(s.q.reshape(rows, -1), fmt.subblock)
    scales = s.scales.reshape(rows, -1)
    biases = s.biases.reshape(rows, -1)
    if scale_dtype is not None:
        scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    return Affine(pack_bits(q, fmt.bits), scales, biases)


def dequantize_affine(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                      subblock: int = 32, group_size: int = 32) -> np.ndarray:
    """NumPy reference of MLX's affine dequantization (float32), dropping sub-block padding."""
    q = unpack_bits(weight, bits).astype(np.float32)
    lead = q.shape[:-1]
    q = q.reshape(*lead, -1, group_size)
    w = q * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    w = w.reshape(*lead, -1)
    return unpad_subblocks(w, subblock)
