"""Tensor-by-tensor repacking of a GGUF into MLX arrays (NumPy), exact or in a lossy precision."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.errors import NonFiniteError
from mlx_dgemma.schema import ModelArgs, QuantSpec
from mlx_dgemma.tiers import SCALE_DTYPE, requantize, target
from .errors import ConvertError
from .names import expected_tensors, mlx_name, module_path, stored_names
from .quants import (FLOAT_TYPES, FORMATS, SUPPORTED_TYPES, dequantize_affine, narrowest_exact_dtype,
                     repack_rows)

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
    max_abs_error: float = 0.0  # lossy precisions: max |stored - exact| (0: this tensor is exact)
    rel_rms_error: float = 0.0  # sqrt(sum (stored - exact)^2 / sum exact^2)

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


def convert_tensor(t, precision: str = "exact", num_layers: int = 0) -> Converted:
    """Repack one GGUF tensor; quantized matrices become weight/scales/biases.

    ``precision`` "exact" repacks bit-exactly; a lossy precision (``mlx_dgemma.tiers``) either
    keeps the exact integers with float16 scales or re-quantizes the tensor with the one
    re-quantizer (:func:`mlx_dgemma.tiers.requantize`), and records its error against the exact
    values. ``num_layers`` tells the tier recipes which layers are the first and last.
    """
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
    goal = target(precision, module_path(path), qtype.name, num_layers, width)
    err = _Error()
    step = max(1, _CHUNK_BYTES // max(1, raw2.shape[1]))
    if goal is not None:
        bits, group, subblock = goal.bits, goal.group_size, 32
        w_out = np.empty((rows, width * bits // 32), dtype=np.uint32)
        s_out = np.empty((rows, width // group), dtype=SCALE_DTYPE)
        b_out = np.empty_like(s_out)
        for r0 in range(0, rows, step):
            chunk = raw2[r0:r0 + step]
            exact = gguf_dequantize(chunk, qtype).reshape(chunk.shape[0], width)
            try:
                r = requantize(exact, goal)
            except OverflowError as e:
                raise ConvertError(f"tensor {t.name!r}: {e}; convert it with --precision exact") from None
            w_out[r0:r0 + step], s_out[r0:r0 + step], b_out[r0:r0 + step] = r.weight, r.scales, r.biases
            err.add(r.max_abs_error, r.sq_error, r.sq_exact)
        scale_dtype = SCALE_DTYPE
    else:
        bits, group, subblock = fmt.bits, 32, fmt.subblock
        padded = width * (2 if subblock == 16 else 1)
        w_out = np.empty((rows, padded * bits // 32), dtype=np.uint32)
        s_out = np.empty((rows, padded // 32), dtype=np.float32)
        b_out = np.empty_like(s_out)
        for r0 in range(0, rows, step):
            a = repack_rows(raw2[r0:r0 + step], qtype)
            w_out[r0:r0 + step], s_out[r0:r0 + step], b_out[r0:r0 + step] = a.weight, a.scales, a.biases
        _check_finite(t.name, np.isfinite(s_out), "scales")
        _check_finite(t.name, np.isfinite(b_out), "offsets")
        scale_dtype = narrowest_exact_dtype(s_out, b_out)
        if precision != "exact" and scale_dtype != np.float16 and _fits_half(s_out, b_out):
            scale_dtype = np.float16  # lossy: the exact integers with rounded scales
            for r0 in range(0, rows, step):
                sl = slice(r0, r0 + step)
                exact = dequantize_affine(w_out[sl], s_out[sl], b_out[sl], bits, subblock)
                lossy = dequantize_affine(w_out[sl], s_out[sl].astype(np.float16), b_out[sl].astype(np.float16),
                                          bits, subblock)
                diff = lossy - exact
                err.add(float(np.abs(diff).max(initial=0.0)), float(np.square(diff, dtype=np.float64).sum()),
                        float(np.square(exact, dtype=np.float64).sum()))
        # else: float16 is exact, or would overflow (kept float32 then): this tensor stays exact
    lead = shape[:-1]
    parts = (w_out, s_out.astype(scale_dtype, copy=False), b_out.astype(scale_dtype, copy=False))
    arrays = {name: a.reshape(*lead, -1) for name, a in zip(stored_names(path, quantized=True), parts)}
    spec = QuantSpec(bits, group, np.dtype(scale_dtype).name, subblock, qtype.name)
    return Converted(t.name, module_path(path), qtype.name, arrays, spec, n_el, int(t.n_bytes),
                     err.max_abs, err.rel_rms)


class _Error:
    """Running max and relative RMS of (lossy - exact) over a tensor's row chunks."""

    def __init__(self) -> None:
        self.max_abs, self.sq, self.ref = 0.0, 0.0, 0.0

    def add(self, max_abs: float, sq: float, ref: float) -> None:
        self.max_abs, self.sq, self.ref = max(self.max_abs, max_abs), self.sq + sq, self.ref + ref

    @property
    def rel_rms(self) -> float:
        return float(np.sqrt(self.sq / self.ref)) if self.ref > 0 else 0.0


def _fits_half(*arrays: np.ndarray) -> bool:
    """Every value within float16's range (else float16 scales would be Inf)."""
    limit = float(np.finfo(np.float16).max)
    return all(float(np.abs(a).max(initial=0.0)) <= limit for a in arrays)


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
