"""Per-type exactness of the repack on random valid ggml blocks."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.convert.quants import (FORMATS, narrowest_exact_dtype, pack_bits, pad_subblocks,
                                       repack_rows, unpack_bits, unpad_subblocks)


def random_valid_blocks(qtype, rows, cols, rng):
    """Random bytes, with every float16 field replaced by a finite value over a wide range
    (subnormal to large), so only the sign of zero could ever differ."""
    fmt = FORMATS[qtype]
    nb = rows * cols // fmt.block_size()
    raw = rng.integers(0, 256, (nb, fmt.type_size()), dtype=np.uint8)
    d_off, m_off, _ = fmt.fp16_fields
    for off in (d_off, m_off):
        if off is None:
            continue
        mag = 10.0 ** rng.uniform(-7, 3, nb)
        vals = (rng.choice([-1.0, 1.0], nb) * mag).astype(np.float16)
        vals[:4] = np.array([0.0, 6e-8, -65504 / 256, 1.0], dtype=np.float16)[: min(4, nb)]
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def mlx_dequant(a, fmt):
    out = mx.dequantize(mx.array(a.weight), mx.array(a.scales.astype(np.float32)),
                        mx.array(a.biases.astype(np.float32)), group_size=32, bits=fmt.bits)
    return unpad_subblocks(np.array(out), fmt.subblock)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_repack_is_bit_exact_against_gguf_py(qtype):
    rng = np.random.default_rng(qtype.value)
    rows, cols = 24, 1024
    raw = random_valid_blocks(qtype, rows, cols, rng)
    ref = gguf_dequantize(raw, qtype).reshape(rows, cols)
    assert np.isfinite(ref).all()
    a = repack_rows(raw, qtype)
    ours = mlx_dequant(a, FORMATS[qtype])
    assert ours.dtype == np.float32
    assert np.array_equal(ours, ref)  # as float32 values (+0.0 == -0.0)
    nz = ref != 0
    assert np.array_equal(ours[nz].view(np.uint32), ref[nz].view(np.uint32))  # bitwise where nonzero


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_narrowest_dtype_keeps_exactness(qtype):
    rng = np.random.default_rng(100 + qtype.value)
    raw = random_valid_blocks(qtype, 8, 512, rng)
    a = repack_rows(raw, qtype)
    dt = narrowest_exact_dtype(a.scales, a.biases)
    b = repack_rows(raw, qtype, scale_dtype=dt)
    assert np.array_equal(mlx_dequant(b, FORMATS[qtype]), gguf_dequantize(raw, qtype).reshape(8, 512))


def test_legacy_types_fit_float16_and_k_quants_need_float32():
    rng = np.random.default_rng(7)
    for qtype in (T.Q4_1, T.Q5_1):
        a = repack_rows(random_valid_blocks(qtype, 4, 256, rng), qtype)
        assert narrowest_exact_dtype(a.scales, a.biases) == np.float16
    for qtype in (T.Q4_K, T.Q6_K):
        a = repack_rows(random_valid_blocks(qtype, 4, 256, rng), qtype)
        assert narrowest_exact_dtype(a.scales, a.biases) == np.float32


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_pack_bits_matches_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (5, 64)).astype(np.uint8)
    w = pack_bits(q, bits)
    assert w.dtype == np.uint32 and w.shape == (5, 64 * bits // 32)
    assert np.array_equal(unpack_bits(w, bits), q)
    ones = np.ones((5, 2), np.float32)
    deq = mx.dequantize(mx.array(w), mx.array(ones), mx.array(0 * ones), group_size=32, bits=bits)
    assert np.array_equal(np.array(deq), q.astype(np.float32))
    # ...and the very words MLX's own quantizer writes: with 0 and 2^bits - 1 in every group its
    # scale is +-1, so its integers are known exactly and must pack as ours do.
    q.reshape(5, 2, 32)[:, :, 0] = 0
    q.reshape(5, 2, 32)[:, :, 1] = 2**bits - 1
    wq, s, b = mx.quantize(mx.array(q.astype(np.float32)), group_size=32, bits=bits)
    s, b = np.array(s)[..., None], np.array(b)[..., None]
    assert np.all(np.abs(s) == 1)
    theirs = ((q.reshape(5, 2, 32) - b) / s).reshape(5, 64).astype(np.uint8)
    assert np.array_equal(np.array(wq), pack_bits(theirs, bits))


def test_padding_roundtrip():
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    p = pad_subblocks(x, 16)
    assert p.shape == (2, 128)
    assert np.all(p.reshape(2, 4, 2, 16)[:, :, 1] == 0)
    assert np.array_equal(unpad_subblocks(p, 16), x)
