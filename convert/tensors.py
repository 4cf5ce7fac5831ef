"""Tensor-by-tensor repacking of a GGUF into MLX arrays (NumPy), exact or compact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.errors import NonFiniteError
from mlx_dgemma.schema import ModelArgs, QuantSpec
from .errors import ConvertError
from .names import expected_tensors, mlx_name, module_path, stored_names
from .quants import (FLOAT_TYPES, FORMATS, SUPPORTED_TYPES, dequantize_affine, narrowest_exact_dtype,
                     pack_bits, repack_rows)

# Rows of ggml blocks repacked at a time: bounds the temporary arrays to a few tens of MB.
_CHUNK_BYTES = 8 << 20


@dataclass
class Converted:
    """One GGUF tensor as MLX arrays: {MLX name: array}, plus its quantization spec and error."""

    gguf_name: str
    module: str  # MLX module path: the key of ``spec`` in config.json's quantization section
    ggml_type: str
    arrays: dict[str, np.ndarray]
    spec: QuantSpec | None
    n_elements: int
    gguf_bytes: int
    max_abs_error: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _rows(t) -> tuple[int, int]:
    """(rows, row_elements) of a GGUF tensor in MLX order (rows = product of outer dims)."""
    ne = [int(x) for x in t.shape]
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    return rows, ne[0]


def _mlx_shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))


def check_inventory(reader: GGUFReader, cfg: ModelArgs, source: str) -> None:
    """Every tensor known, present, with the expected shape and a supported type."""
    expected = {e.name: e for e in expected_tensors(cfg)}
    present = {t.name: t for t in reader.tensors}
    for name, t in present.items():
        if name not in expected:
            known = "; ".join(sorted({n if not n.startswith("blk.") else "blk.N." + n.split(".", 2)[2]
                                      for n in expected}))
            raise ConvertError(f"{source}: unexpected tensor {name!r}; a DiffusionGemma GGUF holds "
                               f"only: {known}")
        if mlx_name(name) is None:  # pragma: no cover - the map and the inventory agree (tested)
            raise ConvertError(f"{source}: tensor {name!r} has no MLX name")
    for name, e in expected.items():
        t = present.get(name)
        if t is None:
            raise ConvertError(f"{source}: tensor {name!r} is missing (expected shape "
                               f"{list(e.ne)}); the file is incomplete or not a DiffusionGemma GGUF")
        ne = tuple(int(x) for x in t.shape)
        if ne != e.ne:
            raise ConvertError(f"{source}: tensor {name!r} has shape {list(ne)}, expected "
                               f"{list(e.ne)} from the file's metadata")
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(x.name for x in SUPPORTED_TYPES)
            raise ConvertError(f"{source}: tensor {name!r} has ggml type {t.tensor_type.name}, which "
                               f"mlx-dgemma does not support (supported: {names}); re-quantize the "
                               "model with one of those types")
        if t.tensor_type in FORMATS and not e.matrix:
            raise ConvertError(f"{source}: tensor {name!r} is quantized ({t.tensor_type.name}) but "
                               "must be F32/F16/BF16 (it is a norm, scale or router vector)")


def _compact_8bit(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Requantize float32 rows to 8-bit group-32 affine with float16 scale and bias."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    lo, hi = g.min(-1), g.max(-1)
    scale = ((hi - lo) / 255).astype(np.float16)
    bias = lo.astype(np.float16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 == 0, 1, s32)
    q = np.clip(np.rint((g - bias.astype(np.float32)[..., None]) / safe[..., None]), 0, 255)
    return q.astype(np.uint8).reshape(w.shape), scale, bias


def convert_tensor(t, compact: bool = False) -> Converted:
    """Repack one GGUF tensor; quantized matrices become weight/scales/biases."""
    path = mlx_name(t.name)
    shape = _mlx_shape(t)
    qtype = t.tensor_type
    n_el = int(np.prod(shape))
    raw = np.asarray(t.data)
    if qtype in FLOAT_TYPES:
        if qtype == T.BF16:
            arr = np.ascontiguousarray(raw).view(np.uint16).reshape(shape)
            _check_finite(t.name, (arr & 0x7F80) != 0x7F80)  # exponent all ones: Inf or NaN
            arrays = {path: BF16Payload(arr)}
        else:
            arrays = {path: np.ascontiguousarray(raw, dtype=FLOAT_TYPES[qtype]).reshape(shape)}
            _check_finite(t.name, np.isfinite(arrays[path]))
        return Converted(t.name, module_path(path), qtype.name, arrays, None, n_el, int(t.n_bytes))

    fmt = FORMATS[qtype]
    rows, width = _rows(t)
    raw2 = raw.reshape(rows, -1)
    requant = compact and fmt.subblock == 16 and fmt.bits > 4
    bits = 8 if requant else fmt.bits
    subblock = 32 if requant else fmt.subblock
    padded = width * (2 if subblock == 16 else 1)
    w_out = np.empty((rows, padded * bits // 32), dtype=np.uint32)
    s_out = np.empty((rows, padded // 32), dtype=np.float16 if requant else np.float32)
    b_out = np.empty_like(s_out)
    err = 0.0
    step = max(1, _CHUNK_BYTES // max(1, raw2.shape[1]))
    for r0 in range(0, rows, step):
        chunk = raw2[r0:r0 + step]
        if requant:
            exact = gguf_dequantize(chunk, qtype).reshape(chunk.shape[0], width)
            q, s, b = _compact_8bit(exact)
            w_out[r0:r0 + step] = pack_bits(q, 8)
            s_out[r0:r0 + step], b_out[r0:r0 + step] = s, b
            back = q.reshape(*q.shape[:-1], -1, 32) * s.astype(np.float32)[..., None] \
                + b.astype(np.float32)[..., None]
            err = max(err, float(np.abs(back.reshape(exact.shape) - exact).max(initial=0.0)))
        else:
            a = repack_rows(chunk, qtype)
            w_out[r0:r0 + step], s_out[r0:r0 + step], b_out[r0:r0 + step] = a.weight, a.scales, a.biases
            if compact:  # float16 scales: measure against the exact float32 ones
                exact = dequantize_affine(a.weight, a.scales, a.biases, bits)
                lossy = dequantize_affine(a.weight, a.scales.astype(np.float16), a.biases.astype(np.float16), bits)
                err = max(err, float(np.abs(lossy - exact).max(initial=0.0)))
    _check_finite(t.name, np.isfinite(s_out), "scales")
    _check_finite(t.name, np.isfinite(b_out), "offsets")
    if compact:
        scale_dtype = np.float16
    else:
        scale_dtype = narrowest_exact_dtype(s_out, b_out)
    lead = shape[:-1]
    parts = (w_out, s_out.astype(scale_dtype, copy=False), b_out.astype(scale_dtype, copy=False))
    arrays = {name: a.reshape(*lead, -1) for name, a in zip(stored_names(path, quantized=True), parts)}
    spec = QuantSpec(bits, 32, np.dtype(scale_dtype).name, subblock, qtype.name)
    return Converted(t.name, module_path(path), qtype.name, arrays, spec, n_el, int(t.n_bytes), err)


def _check_finite(name: str, finite: np.ndarray, what: str = "values") -> None:
    """NaN/Inf in a weight is an error naming the tensor (it would give blank answers later)."""
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise NonFiniteError(f"tensor {name!r}: {bad} of {finite.size} {what} are NaN or Inf; the file is "
                             "corrupt, download it again")


class BF16Payload(np.ndarray):
    """uint16 payload tagged as bfloat16 for the safetensors writer."""

    def __new__(cls, a: np.ndarray):
        return np.asarray(a, dtype=np.uint16).view(cls)
