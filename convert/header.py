"""A scanned GGUF's metadata and tensor table, its values read from the file when asked for.

gguf-py's ``GGUFReader`` builds a NumPy view for every item of every metadata array when it
opens a file: the published model's 262,144-token vocabulary (tokens, scores, token types) is
~790,000 views: 18-78 s (by the machine's load) and 0.77 GB of memory on the 2-core Linux
machine before the first weight is read, at every ``chat``/``serve``/``plan``/``convert`` of a
.gguf (``benchmarks/gguf_open.py``). The bounded
pre-scan (:mod:`.scan`) already walks every key once, checking each count against the file; it
records where each value starts, and :class:`GGUFHeader` decodes a value from there when it is
asked for: numbers with gguf-py's own type table (one ``frombuffer`` an array), strings one
pass. The same values as gguf-py's reader (``tests/test_header.py`` compares every key and tensor
of real llama.cpp files), in ~1 s and 0.08 GB.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from .scan import GGUFScan

# gguf-py's value types as NumPy dtypes (its reader's own table), little-endian as GGUF stores them
_SCALARS: dict[int, np.dtype] = {int(t): np.dtype(d).newbyteorder("<")
                                 for t, d in GGUFReader.gguf_scalar_to_np.items()}
# tensor element types NumPy holds as they are (gguf-py's reader's choice); the rest are bytes
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class HeaderTensor:
    """One entry of the tensor table, with the attributes of gguf-py's ``ReaderTensor`` that the
    converter reads: ``shape`` in ggml order (row length first), ``data_offset`` absolute."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    _map: np.memmap

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes in the file's memory map, shaped as gguf-py's reader shapes them:
        float and integer types as their elements [..., row], block types as bytes
        [..., bytes per row]."""
        raw = self._map[self.data_offset:self.data_offset + self.n_bytes]
        dims = tuple(reversed(self.shape))
        dtype = _ELEMENT_DTYPES.get(self.tensor_type)
        if dtype is None:
            return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))
        return raw.view(dtype).reshape(dims)


class GGUFHeader:
    """A GGUF's metadata and tensor table as :func:`~.scan.scan_gguf` found them (every count
    already checked against the file): ``kinds`` (key -> value type, item type, count),
    ``tensors`` (in table order), ``data_offset`` (where tensor data starts) and ``data`` (the
    file, memory-mapped read-only). Values are decoded by :meth:`value` when asked for."""

    def __init__(self, path: str | Path, scan: GGUFScan):
        self.path = Path(path)
        self.kinds = scan.kinds
        self._values = scan.values
        self.data_offset = scan.data_start
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = [
            HeaderTensor(t.name, GGMLQuantizationType(t.ggml_type), t.dims, int(np.prod(t.dims)), t.n_bytes,
                         t.offset, self.data)
            for t in scan.tensors]

    def keys(self) -> list[str]:
        """Every metadata key, in file order."""
        return list(self.kinds)

    def __contains__(self, key: str) -> bool:
        return key in self.kinds

    def value(self, key: str) -> Any:
        """``key``'s value as plain Python: str, int, float or bool, or a list of them (KeyError
        for a key the file does not have)."""
        vtype, itype, off = self._values[key]
        if vtype == GGUFValueType.ARRAY:
            count = self.kinds[key][2]
            if itype == GGUFValueType.STRING:
                return self._strings(off, count)
            dt = _SCALARS[itype]
            return np.frombuffer(self.data, dtype=dt, count=count, offset=off).tolist()
        if vtype == GGUFValueType.STRING:
            return self._strings(off, 1)[0]
        return np.frombuffer(self.data, dtype=_SCALARS[vtype], count=1, offset=off).tolist()[0]

    def _strings(self, off: int, count: int) -> list[str]:
        # the scan checked every length against the file and every string as UTF-8; slices of a
        # memoryview, not of the memmap (each of those is a new ndarray: gguf-py's cost)
        buf, unpack, out = memoryview(self.data), _U64.unpack_from, []
        for _ in range(count):
            (n,) = unpack(buf, off)
            off += 8
            out.append(str(buf[off:off + n], "utf-8", "surrogateescape"))
            off += n
        return out
