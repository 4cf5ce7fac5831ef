"""MLX's packed layout of quantized integers: each row an LSB-first bitstream in uint32 words.

NumPy only: the converter's exact repacking (``convert/quants.py``) and the re-quantizer
(:mod:`mlx_dgemma.tiers`) write and read the same bits through these functions.
"""

from __future__ import annotations

import numpy as np

# Elements per whole-byte chunk of each width (``per * bits / 8`` bytes), packed in the
# narrowest unsigned integer that holds a chunk (no 64-bit temporaries but for 5 bits).
PER_CHUNK = {1: 8, 2: 4, 3: 8, 4: 2, 5: 8, 6: 4, 8: 1}


def chunk_type(nbytes: int) -> type:
    """The narrowest of uint8, uint32 and uint64 that holds ``nbytes`` bytes."""
    return np.uint8 if nbytes == 1 else np.uint32 if nbytes <= 4 else np.uint64


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``q`` ([..., n] uint8, n*bits % 32 == 0) into MLX's uint32 layout.

    MLX reads each row as an LSB-first bitstream: element j occupies bits
    [j*bits, (j+1)*bits) of the row's little-endian byte string.
    """
    lead, n = q.shape[:-1], q.shape[-1]
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    per = PER_CHUNK[bits]
    nbytes = per * bits // 8
    acc_t = chunk_type(nbytes)
    chunks = q.reshape(*lead, n // per, per)
    acc = chunks[..., 0].astype(acc_t)
    for i in range(1, per):
        acc |= chunks[..., i].astype(acc_t) << acc_t(bits * i)
    raw = acc.view(np.uint8).reshape(*acc.shape, np.dtype(acc_t).itemsize)[..., :nbytes]
    return np.ascontiguousarray(raw).reshape(*lead, n * bits // 8).view(np.uint32)


def unpack_bits(w: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`."""
    raw = np.ascontiguousarray(w).view(np.uint8)
    lead, nb = raw.shape[:-1], raw.shape[-1]
    if bits == 8:
        return raw.copy()
    per = PER_CHUNK[bits]
    nbytes = per * bits // 8
    acc_t = chunk_type(nbytes)
    by = raw.reshape(*lead, nb // nbytes, nbytes)
    acc = by[..., 0].astype(acc_t)
    for i in range(1, nbytes):
        acc |= by[..., i].astype(acc_t) << acc_t(8 * i)
    out = np.empty((*acc.shape, per), dtype=np.uint8)
    mask = acc_t((1 << bits) - 1)
    for i in range(per):
        np.bitwise_and(acc >> acc_t(bits * i), mask, out=out[..., i], casting="unsafe")
    return out.reshape(*lead, nb // nbytes * per)
