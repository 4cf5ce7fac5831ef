"""Float weights -> ggml blocks (Q4_K, Q6_K; Q5_0 and Q8_0 through gguf-py), and a K-quant copy
of a GGUF under llama.cpp's Q4_K_M type rule.

gguf-py writes no K-quant blocks, so these are our own, simple (min-max sub-block ranges, no
iterative search: a little less accurate than llama.cpp's, the same format). Used to make a
K-quant copy of the trained demo model, whose shipped file is Q8_0 only, so that the K-quant
paths (fast's Q6_K re-quantization, the tiers from Q4_K) are measured on trained weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from .metadata import ARCH
from .names import expected_tensors, q4_k_m_types
from .quants import FLOAT_TYPES
from .source import GGUFSource

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 rows (width a multiple of 256) -> block_q4_K bytes [rows, width/256*144]."""
    rows = w.shape[0]
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(-1), 0)  # the format's offset is -dmin*m <= 0
    hi = x.max(-1)
    scale, offset = (hi - lo) / 15, -lo  # per sub-block, >= 0
    d = scale.max(-1) / 63
    dmin = offset.max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d16 > 0, d16, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / np.where(dmin16 > 0, dmin16, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(np.rint((x + (dmin16[:, None] * m)[..., None]) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    blocks = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 rows (width a multiple of 256) -> block_q6_K bytes [rows, width/256*210]."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(x).max(-1)
    scale = amax / 31  # q - 32 in [-32, 31]
    d = np.abs(scale).max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d16 > 0, d16, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d16[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(x / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    hq = high.reshape(-1, 2, 4, 32)
    qh = (hq[:, :, 0] | (hq[:, :, 1] << 2) | (hq[:, :, 2] << 4) | (hq[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d16)], axis=1)
    return blocks.reshape(rows, -1)


def quantize_blocks(w: np.ndarray, qtype: T) -> np.ndarray:
    """float32 rows -> ``qtype`` blocks (uint8 rows)."""
    if qtype == T.Q4_K:
        return quantize_q4_k(w)
    if qtype == T.Q6_K:
        return quantize_q6_k(w)
    return gguf_quantize(w.astype(np.float32), qtype)


def write_kquant_copy(src: str | Path, dst: str | Path) -> Path:
    """A copy of the GGUF ``src`` with every quantized matrix re-quantized from its dequantized
    values under llama.cpp's Q4_K_M type rule (Q4_K for most, Q6_K for the embedding and for
    the ``use_more_bits`` half of attn_v/ffn_down; Q5_0/Q8_0 where a row is not a multiple of
    256); metadata and float tensors copied as they are. Returns ``dst``."""
    with GGUFSource(src) as source:
        types = q4_k_m_types(expected_tensors(source.args))
    reader = GGUFReader(src)
    w = GGUFWriter(str(dst), ARCH)
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in FLOAT_TYPES:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        rows = int(np.prod(shape[:-1]))
        dense = gguf_dequantize(np.asarray(t.data).reshape(rows, -1), t.tensor_type).reshape(rows, shape[-1])
        qtype = types[t.name]
        blocks = quantize_blocks(dense, qtype)
        w.add_tensor(t.name, blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
