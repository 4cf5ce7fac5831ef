"""Tensor-by-tensor repacking of a GGUF into MLX arrays (NumPy), exact or in a lossy precision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as T

from mlx_dgemma.errors import NonFiniteError
from mlx_dgemma.schema import ModelArgs, QuantSpec
from mlx_dgemma.tiers import SCALE_DTYPE, Requantized, ordered_map, requantize_affine, target, workers
from .errors import ConvertError
from .header import GGUFHeader
from .names import expected_tensors, mlx_name, module_path, stored_names
from .quants import (FLOAT_TYPES, FORMATS, dequantize_affine, narrowest_exact_dtype, repack_rows,
                     supported_types)

# Input bytes of the rows read and repacked at a time: bounds the temporary arrays (and, when
# the parts are streamed to disk, the output held) to a few tens of MB.
_CHUNK_BYTES = 8 << 20
# Input bytes repacked at once by the exact path (its temporaries are ~40x the input).
_REPACK_BYTES = 2 << 20
# Input bytes re-quantized at once by a thread (lossy precisions): ~2 M weights, ~10 MB of
# float32 temporaries, several chunks per tensor for the threads to share.
_TIER_CHUNK_BYTES = 1 << 20
_TIER_MIN_CHUNK_BYTES = 1 << 15  # ~60 K weights: a few blocks' worth of per-call work


@dataclass
class Part:
    """One output array, produced row chunk by row chunk so that a large tensor is never whole
    in memory: its shape is known up front, its dtype up front or, for exact scales, once its
    tensor's weight was produced (``dtypes`` then lists the candidates, narrowest first).
    ``chunks()`` may be iterated once, after the parts before it in its :class:`Converted`."""

    shape: tuple[int, ...]
    dtypes: tuple[np.dtype, ...]
    produce: Callable[[], Iterator[np.ndarray]]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        if len(self.dtypes) != 1:
            raise RuntimeError("the dtype of this part is known once its tensor's weight was produced")
        return self.size * self.dtypes[0].itemsize

    def chunks(self) -> Iterator[np.ndarray]:
        return self.produce()

    def materialize(self) -> np.ndarray:
        """The whole array (for callers that keep it: the loader, verify)."""
        out: np.ndarray | None = None
        r = 0
        for c in self.chunks():
            c2 = c.reshape(c.shape[0], -1)
            if out is None:
                out = np.empty((self.size // c2.shape[1], c2.shape[1]), dtype=c.dtype)
            out[r:r + c2.shape[0]] = c2
            r += c2.shape[0]
        assert out is not None
        out = out.reshape(self.shape)
        return BF16Payload(out) if out.dtype == np.uint16 else out


@dataclass
class Converted:
    """One GGUF tensor as MLX arrays: {MLX name: :class:`Part`}, plus its quantization spec and
    error. The parts are produced lazily, in order; ``arrays`` materializes them."""

    gguf_name: str
    module: str  # MLX module path: the key of ``spec`` in config.json's quantization section
    ggml_type: str
    parts: dict[str, Part]
    spec: QuantSpec | None  # final once the parts are produced (an exact K-quant's scale dtype is decided then)
    n_elements: int
    gguf_bytes: int
    error: "_Error" = field(default_factory=lambda: _Error())
    prepare: Callable[[], None] | None = None  # fixes deferred dtypes before production (costs a pass)
    _arrays: dict[str, np.ndarray] | None = None

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """{MLX name: whole array} (produces the parts; for callers that keep the arrays)."""
        if self._arrays is None:
            self._arrays = {name: p.materialize() for name, p in self.parts.items()}
        return self._arrays

    def nbytes_range(self) -> tuple[int, int]:
        """Fewest and most bytes the arrays can take (equal unless a scale dtype is deferred)."""
        lo = sum(p.size * min(d.itemsize for d in p.dtypes) for p in self.parts.values())
        hi = sum(p.size * max(d.itemsize for d in p.dtypes) for p in self.parts.values())
        return lo, hi

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def max_abs_error(self) -> float:
        """Lossy precisions: max |stored - exact| (0: this tensor is exact); known once produced."""
        return self.error.max_abs

    @property
    def rel_rms_error(self) -> float:
        """sqrt(sum (stored - exact)^2 / sum exact^2); known once produced."""
        return self.error.rel_rms


def _rows(t) -> tuple[int, int]:
    """(rows, row_elements) of a GGUF tensor in MLX order (rows = product of outer dims)."""
    ne = [int(x) for x in t.shape]
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    return rows, ne[0]


def _mlx_shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))


def check_inventory(reader: GGUFHeader, cfg: ModelArgs, source: str) -> None:
    """Every tensor known, present, with the expected shape and a supported type."""
    expected = {e.name: e for e in expected_tensors(cfg)}
    present = {t.name: t for t in reader.tensors}
    supported = supported_types()
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
        if t.tensor_type not in supported:
            names = ", ".join(x.name for x in supported)
            raise ConvertError(f"{source}: tensor {name!r} has ggml type {t.tensor_type.name}, which "
                               f"mlx-dgemma does not support (supported: {names}); re-quantize the "
                               "model with one of those types")
        if t.tensor_type in FORMATS and not e.matrix:
            raise ConvertError(f"{source}: tensor {name!r} is quantized ({t.tensor_type.name}) but "
                               f"must be {'/'.join(f.name for f in FLOAT_TYPES)} (it is a norm, scale or router "
                               "vector)")


def _row_reader(t, rows: int) -> Callable[[int, int], np.ndarray]:
    """Rows [r0, r1) of ``t``'s raw data as uint8 [r1 - r0, bytes per row]: read from the file
    chunk by chunk when ``t`` can (``GGUFSource``), else sliced from ``t.data``."""
    read = getattr(t, "read_rows", None)
    if read is not None:
        return read
    raw = np.asarray(t.data)
    raw2 = raw.reshape(rows, -1).view(np.uint8) if raw.dtype != np.uint8 else raw.reshape(rows, -1)
    return lambda r0, r1: raw2[r0:r1]


def convert_tensor(t, precision: str = "exact", num_layers: int = 0) -> Converted:
    """Repack one GGUF tensor; quantized matrices become weight/scales/biases.

    ``precision`` "exact" repacks bit-exactly; a lossy precision (``mlx_dgemma.tiers``) either
    keeps the exact integers with float16 scales or re-quantizes the tensor with the one
    re-quantizer (:func:`mlx_dgemma.tiers.requantize_affine`), and records its error against the exact
    values. ``num_layers`` tells the tier recipes which layers are the first and last.

    Nothing is computed here: the returned parts read and repack ``t`` in row chunks of about
    ``_CHUNK_BYTES`` of input as they are consumed, so a writer streaming them holds one chunk
    (plus the tensor's scales), never the whole tensor.
    """
    path = mlx_name(t.name)
    shape = _mlx_shape(t)
    qtype = t.tensor_type
    n_el = int(np.prod(shape))
    rows, width = _rows(t)
    read = _row_reader(t, rows)
    row_bytes = int(t.n_bytes) // rows
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    if qtype in FLOAT_TYPES:
        dtype = np.dtype(np.uint16 if qtype == T.BF16 else FLOAT_TYPES[qtype])

        def floats() -> Iterator[np.ndarray]:
            bad = 0
            for r0 in range(0, rows, step):
                a = np.ascontiguousarray(read(r0, min(rows, r0 + step))).view(dtype)
                finite = (a & 0x7F80) != 0x7F80 if qtype == T.BF16 else np.isfinite(a)  # BF16: exponent all ones
                bad += int(finite.size - np.count_nonzero(finite))
                yield a
            _check_finite(t.name, bad, n_el)

        parts = {path: Part(shape, (dtype,), floats)}
        return Converted(t.name, module_path(path), qtype.name, parts, None, n_el, int(t.n_bytes))

    fmt = FORMATS[qtype]
    lead = shape[:-1]
    names = stored_names(path, quantized=True)
    goal = target(precision, module_path(path), qtype.name, num_layers, width)
    err = _Error()
    if goal is not None:
        bits, group, subblock = goal.bits, goal.group_size, 32
        s_out = np.empty((rows, width // group), dtype=SCALE_DTYPE)
        b_out = np.empty_like(s_out)
        tstep = _tier_rows(rows, row_bytes)

        def requantize_rows(r0: int) -> Requantized:
            # the exact integers and scales of these rows, straight from the blocks (the values
            # q * scale + bias are gguf-py's, bit for bit: see quants.py), re-quantized
            chunk = read(r0, min(rows, r0 + tstep))
            s = fmt.split(np.ascontiguousarray(chunk).reshape(-1, fmt.type_size()))
            n = chunk.shape[0]
            # NaN/Inf scales make NaN/Inf values: a corrupt file, not a range float16 lacks
            bad = [_count_bad(a) for a in (s.scales, s.biases)]
            _check_finite(t.name, sum(x for x, _ in bad), sum(y for _, y in bad),
                          f"scales and offsets of rows {r0}..{r0 + n - 1}")
            try:
                return requantize_affine(s.q.reshape(n, width), s.scales.reshape(n, -1), s.biases.reshape(n, -1),
                                         fmt.bits, fmt.subblock, goal)
            except OverflowError as e:
                raise ConvertError(f"tensor {t.name!r}: {e}; convert it with --precision exact") from None

        def requantized() -> Iterator[np.ndarray]:
            # row chunks on several threads, taken in order: the same numbers as one thread
            for r0, r in zip(range(0, rows, tstep), ordered_map(requantize_rows, range(0, rows, tstep))):
                s_out[r0:r0 + tstep], b_out[r0:r0 + tstep] = r.scales, r.biases
                err.add(r.max_abs_error, r.sq_error, r.sq_exact)
                yield r.weight

        sd = (np.dtype(SCALE_DTYPE),)
        parts = {names[0]: Part((*lead, width * bits // 32), (np.dtype(np.uint32),), requantized),
                 names[1]: Part((*lead, width // group), sd, lambda: _slices(s_out, step)),
                 names[2]: Part((*lead, width // group), sd, lambda: _slices(b_out, step))}
        spec = QuantSpec(bits, group, np.dtype(SCALE_DTYPE).name, subblock, qtype.name)
        return Converted(t.name, module_path(path), qtype.name, parts, spec, n_el, int(t.n_bytes), err)

    job = _ExactRepack(t.name, qtype, rows, width, read, step, precision, err)
    groups = job.padded // 32
    parts = {names[0]: Part((*lead, job.padded * fmt.bits // 32), (np.dtype(np.uint32),), job.weights),
             names[1]: Part((*lead, groups), job.scale_dtypes, lambda: job.scales("s")),
             names[2]: Part((*lead, groups), job.scale_dtypes, lambda: job.scales("b"))}
    job.parts = (parts[names[1]], parts[names[2]])
    # the spec's scale dtype is fixed once the weight was produced (job._decide replaces it)
    c = Converted(t.name, module_path(path), qtype.name, parts, QuantSpec(fmt.bits, 32, "float32", fmt.subblock,
                  qtype.name), n_el, int(t.n_bytes), err, prepare=job.prepare)
    job.converted = c
    return c


def _tier_rows(rows: int, row_bytes: int) -> int:
    """Rows a thread re-quantizes at a time: about ``_TIER_CHUNK_BYTES`` of input, and fewer for a
    tensor that would otherwise be one or two chunks, so that every thread has a share of it
    (tensors are taken one at a time: a one-chunk tensor kept all but one thread idle, most of
    a small model's). Never under ``_TIER_MIN_CHUNK_BYTES``, where the per-call work would
    outweigh the share. Rows are whole, and each group depends on its own values alone, so no
    chunking changes a number."""
    per_thread = -(-rows // (2 * workers()))  # two chunks a thread: one finishing, one started
    least = max(1, _TIER_MIN_CHUNK_BYTES // max(1, row_bytes))
    return max(1, min(_TIER_CHUNK_BYTES // max(1, row_bytes), max(per_thread, least)))


def _slices(a: np.ndarray, step: int) -> Iterator[np.ndarray]:
    for r0 in range(0, a.shape[0], step):
        yield a[r0:r0 + step]


class _ExactRepack:
    """The exact integers of a ggml tensor, repacked chunk by chunk (:func:`repack_rows`); the
    float32 scales and offsets are kept (1/32 of the elements each) because their stored dtype
    (float16 where that is exact, or where a lossy precision accepts rounding) is known only once
    all are seen. ``prepare`` decides it up front at the cost of a second repacking pass."""

    def __init__(self, name: str, qtype: T, rows: int, width: int, read: Callable[[int, int], np.ndarray],
                 step: int, precision: str, err: "_Error") -> None:
        fmt = FORMATS[qtype]
        self.name, self.qtype, self.rows, self.read, self.step = name, qtype, rows, read, step
        self.bits, self.subblock, self.precision, self.err = fmt.bits, fmt.subblock, precision, err
        self.padded = width * (2 if fmt.subblock == 16 else 1)
        self.s_out = np.empty((rows, self.padded // 32), dtype=np.float32)
        self.b_out = np.empty_like(self.s_out)
        self.have_scales = False
        self.scale_dtypes: tuple[np.dtype, ...] = (np.dtype(np.float16), np.dtype(np.float32))
        self.parts: tuple[Part, ...] = ()
        self.converted: Converted | None = None
        self.half_ok = True  # every chunk's scales and offsets within float16's range
        self.rounded: bool | None = None  # float16 scales that are not exact (None: not decided yet)

    def prepare(self) -> None:
        if self.have_scales:
            return
        sub = max(1, self.step * _REPACK_BYTES // _CHUNK_BYTES)
        for r0 in range(0, self.rows, sub):
            a = repack_rows(self.read(r0, min(self.rows, r0 + sub)), self.qtype)
            self.s_out[r0:r0 + sub], self.b_out[r0:r0 + sub] = a.scales, a.biases
        self.have_scales = True
        self._decide()

    def weights(self) -> Iterator[np.ndarray]:
        lossy = self.precision != "exact"
        sub = max(1, self.step * _REPACK_BYTES // _CHUNK_BYTES)
        for r0 in range(0, self.rows, self.step):
            r1 = min(self.rows, r0 + self.step)
            # repacked in smaller pieces (its temporaries are ~40x the input); the float16 error is
            # summed per chunk of ``step`` rows, as it always was, so the report does not move
            need_err = lossy and self.half_ok and self.rounded is not False
            pieces = []
            for q0 in range(r0, r1, sub):
                q1 = min(r1, q0 + sub)
                a = repack_rows(self.read(q0, q1), self.qtype)
                if not self.have_scales:
                    self.s_out[q0:q1], self.b_out[q0:q1] = a.scales, a.biases
                if need_err:
                    pieces.append(a.weight)
                yield a.weight
            if need_err:
                self._add_error(np.concatenate(pieces), self.s_out[r0:r1], self.b_out[r0:r1])
        if not self.have_scales:
            self.have_scales = True
            self._decide()

    def _add_error(self, w: np.ndarray, s: np.ndarray, b: np.ndarray) -> None:
        """The error of float16 scales on these rows, kept only if the tensor ends up lossy (_decide)."""
        if not _fits_half(s, b):
            self.half_ok = False
            return
        exact = dequantize_affine(w, s, b, self.bits, self.subblock)
        diff = dequantize_affine(w, s.astype(np.float16), b.astype(np.float16), self.bits, self.subblock)
        np.subtract(diff, exact, out=diff)  # in place: the temporaries of a chunk are what fast's peak is
        sq = float(np.square(diff, dtype=np.float64).sum())
        max_abs = float(np.abs(diff, out=diff).max(initial=0.0))
        del diff
        self.err.add(max_abs, sq, float(np.square(exact, dtype=np.float64).sum()))

    def _decide(self) -> None:
        _check_finite(self.name, *_count_bad(self.s_out), "scales")
        _check_finite(self.name, *_count_bad(self.b_out), "offsets")
        dtype = narrowest_exact_dtype(self.s_out, self.b_out)
        lossy = False
        if self.precision != "exact" and dtype != np.float16 and _fits_half(self.s_out, self.b_out):
            dtype, lossy = np.float16, True  # lossy: the exact integers with rounded scales
        # else: float16 is exact, or would overflow (kept float32 then): this tensor stays exact
        self.rounded = lossy
        if not lossy:
            self.err.max_abs, self.err.sq, self.err.ref = 0.0, 0.0, 0.0
        self.scale_dtypes = (np.dtype(dtype),)
        for p in self.parts:
            p.dtypes = self.scale_dtypes
        if self.converted is not None:
            self.converted.spec = QuantSpec(self.bits, 32, np.dtype(dtype).name, self.subblock, self.qtype.name)

    def scales(self, which: str) -> Iterator[np.ndarray]:
        """The scales ("s") or offsets ("b") in their dtype; the offsets come last, then both
        are dropped (the parts and this job refer to each other: a cycle only the garbage
        collector would free, holding a tensor's scales long after it was written)."""
        a = self.s_out if which == "s" else self.b_out
        dtype = self.scale_dtypes[0]
        for r0 in range(0, a.shape[0], 1 << 16):
            yield a[r0:r0 + (1 << 16)].astype(dtype, copy=False)
        if which == "b":
            self.s_out = self.b_out = None
            self.parts, self.converted = (), None


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


def _count_bad(a: np.ndarray, chunk: int = 1 << 20) -> tuple[int, int]:
    """(NaN/Inf values, all values) of ``a``, counted in slices (no full-size temporaries)."""
    flat = a.reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i:i + chunk]))) for i in range(0, flat.size, chunk)), flat.size


def _check_finite(name: str, bad: int, size: int, what: str = "values") -> None:
    """NaN/Inf in a weight is an error naming the tensor (it would give blank answers later)."""
    if bad:
        raise NonFiniteError(f"tensor {name!r}: {bad} of {size} {what} are NaN or Inf; the file is "
                             "corrupt, download it again")


class BF16Payload(np.ndarray):
    """uint16 payload tagged as bfloat16 for the safetensors writer."""

    def __new__(cls, a: np.ndarray):
        return np.asarray(a, dtype=np.uint16).view(cls)
