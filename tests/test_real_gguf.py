"""Exactness on real llama.cpp-quantized data (Gemma 3 270M Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.convert.quants import FORMATS, narrowest_exact_dtype, repack_rows, unpad_subblocks

@pytest.fixture(scope="module")
def reader(gemma3_reader) -> GGUFReader:
    return gemma3_reader


def test_every_quantized_tensor_repacks_bit_exactly(reader):
    seen = set()
    for t in reader.tensors:
        if t.tensor_type not in FORMATS:
            continue
        raw = np.asarray(t.data)
        raw = raw.reshape(-1, raw.shape[-1])[:2048]  # all rows but the embedding's tail
        width = int(t.shape[0])
        ref = gguf_dequantize(raw, t.tensor_type).reshape(raw.shape[0], width)
        a = repack_rows(raw, t.tensor_type)
        dt = narrowest_exact_dtype(a.scales, a.biases)
        fmt = FORMATS[t.tensor_type]
        ours = mx.dequantize(mx.array(a.weight), mx.array(a.scales.astype(dt).astype(np.float32)),
                             mx.array(a.biases.astype(dt).astype(np.float32)), group_size=32, bits=fmt.bits)
        ours = unpad_subblocks(np.array(ours), fmt.subblock)
        assert np.array_equal(ours, ref), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
