"""A GGUF's binary layout, walked before anything is read from it: the bounded pre-scan.

Every count found in the file (metadata entries, array lengths, string lengths, tensors,
dimensions) is checked against the bytes left before anything is allocated or looped on from
it, so a hostile or truncated file fails with one line naming the file, the key or tensor and
the byte, never with a MemoryError, a hang or a crash inside gguf-py. The value types and their
sizes are gguf-py's own. The walk records where each value lies; :class:`~.header.GGUFHeader`
decodes values from there (gguf-py's reader is not used to open a model: see :mod:`.header`).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import ConvertError

MAGIC = b"GGUF"

# metadata scalar type -> bytes, as gguf-py's reader reads them
SCALAR_BYTES: dict[GGUFValueType, int] = {t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}
_MAX_DIMS = 4


def value_type_name(vtype: int) -> str:
    """A metadata value type as the checks and errors name it: 'uint32', 'string', 'array'..."""
    try:
        return GGUFValueType(vtype).name.lower()
    except ValueError:
        return "unknown"


@dataclass
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    n_bytes: int


@dataclass
class GGUFScan:
    """What the pre-scan found: value types per key and the tensor table, all inside the file."""

    version: int
    size: int
    kinds: dict[str, tuple[str, str | None, int]] = field(default_factory=dict)  # key: (type, item type, count)
    # key: (value type, item type or None, byte offset of the value: a string's length prefix, a
    # scalar, an array's first item); what :class:`~.header.GGUFHeader` decodes values from
    values: dict[str, tuple[int, int | None, int]] = field(default_factory=dict)
    arch: str | None = None
    alignment: int = 32
    data_start: int = 0
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf, size: int, source: str):
        self.buf, self.size, self.pos, self.source = buf, size, 0, source

    def fail(self, what: str) -> None:
        raise ConvertError(f"{self.source}: {what} (at byte {self.pos} of {self.size}); the file is truncated "
                         "or corrupt, download it again")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} needs {n} bytes, past the end of the file")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str, decode: bool = True) -> str | None:
        n = self.unpack("<Q", what)
        self.need(n, what)
        if not decode:
            self.pos += n
            return None
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")
        return None


_U64 = struct.Struct("<Q")


def _strings(c: _Cursor, count: int, key: str) -> None:
    """Skip ``count`` length-prefixed strings, each inside the file and UTF-8 (they end up in
    JSON files); the hot loop of a 262k-token vocabulary, hence the local names."""
    buf, pos, end, unpack = c.buf, c.pos, c.size, _U64.unpack_from
    try:
        for i in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                break
            buf[pos:pos + n].decode("utf-8")
            pos += n
        else:
            c.pos = pos
            return
    except UnicodeDecodeError:
        c.pos = pos
        c.fail(f"item {i} of {key!r} is not valid UTF-8")
    c.pos = pos
    c.fail(f"item {i} of {key!r} needs more bytes than the file has")


def scan_gguf(path: Path, expect_arch: str | None, source: str | None = None) -> GGUFScan:
    """Walk a GGUF's header, metadata and tensor table with every count checked against the
    bytes left, before anything is allocated from it. Refuses a file that is not a GGUF from its
    first four bytes and stops early (cheaply) on a ``general.architecture`` other than
    ``expect_arch`` (None: any). Checks tensor types, shapes, alignment, bounds and overlaps."""
    source = source or str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(len(MAGIC))
        if not magic:  # an interrupted download or copy leaves an empty file
            raise ConvertError(f"{source}: the file is empty (0 bytes), not a GGUF; download the .gguf model "
                               "file again")
        if magic != MAGIC:
            raise ConvertError(f"{source}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r}); "
                               "download the .gguf model file itself")
        if size < 24:
            raise ConvertError(f"{source}: {size} bytes is too short for a GGUF header; the file is truncated")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            # slices of an mmap are bytes copies: no exported buffer outlives an error
            return _scan(_Cursor(mm, size, source), size, expect_arch)


def _scan(c: _Cursor, size: int, expect_arch: str | None) -> GGUFScan:
    source = c.source
    c.pos = 4
    version = c.unpack("<I", "version")
    if version not in (2, 3):
        raise ConvertError(f"{source}: GGUF version {version} is not supported (expected 2 or 3; a big-endian "
                    "or future file); convert it with a current llama.cpp")
    n_tensors = c.unpack("<Q", "tensor count")
    n_kv = c.unpack("<Q", "metadata count")
    if n_kv > (size - c.pos) // 13 or n_tensors > (size - c.pos) // 24:
        c.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")
    scan = GGUFScan(version, size)
    for _ in range(n_kv):
        key = c.string("metadata key")
        if key in scan.kinds:
            c.fail(f"metadata key {key!r} appears twice")
        vtype = c.unpack("<I", f"type of {key!r}")
        scan.values[key] = (vtype, None, c.pos)
        if vtype == GGUFValueType.STRING:
            value = c.string(f"value of {key!r}")
            if key == "general.architecture":  # usually the first key: a wrong file is refused at once
                scan.arch = value
                if expect_arch is not None and value != expect_arch:
                    raise ConvertError(f"{source}: general.architecture is {value!r}, expected {expect_arch!r}; "
                                "this tool reads DiffusionGemma GGUF files only")
            scan.kinds[key] = ("string", None, 1)
        elif vtype in SCALAR_BYTES:
            name, n = value_type_name(vtype), SCALAR_BYTES[vtype]
            c.need(n, f"value of {key!r}")
            if key == "general.alignment":
                scan.alignment = int.from_bytes(c.buf[c.pos:c.pos + n], "little") if name.startswith("uint") else -1
            c.pos += n
            scan.kinds[key] = (name, None, 1)
        elif vtype == GGUFValueType.ARRAY:
            itype = c.unpack("<I", f"item type of {key!r}")
            count = c.unpack("<Q", f"length of {key!r}")
            scan.values[key] = (vtype, itype, c.pos)
            if itype in SCALAR_BYTES:
                iname, n = value_type_name(itype), SCALAR_BYTES[itype]
                if count > (size - c.pos) // n:
                    c.fail(f"array {key!r} claims {count} items of {n} bytes, more than the file holds")
                c.pos += count * n
            elif itype == GGUFValueType.STRING:
                iname = "string"
                if count > (size - c.pos) // 8:
                    c.fail(f"array {key!r} claims {count} strings, more than the file holds")
                _strings(c, count, key)
            else:  # nested arrays: no DiffusionGemma key uses them
                c.fail(f"metadata {key!r} is an array of type {itype}; only arrays of numbers, booleans or "
                       "strings are supported")
            scan.kinds[key] = ("array", iname, count)
        else:
            c.fail(f"metadata {key!r} has unknown value type {vtype}")
    kind = scan.kinds.get("general.alignment")
    if kind is not None and kind != ("uint32", None, 1):  # gguf-py reads no other type of it
        raise ConvertError(f"{source}: general.alignment is a{'n' if kind[0][0] in 'ai' else ''} {kind[0]}"
                           f"{f' of {kind[1]}' if kind[1] else ''}, expected a uint32 (GGUF's type for it); "
                           "the file was written by a tool that does not follow the GGUF format")
    align = scan.alignment
    if align < 1 or align > 1 << 20 or align & (align - 1):
        raise ConvertError(f"{source}: general.alignment = {align}: must be a power of two up to 1048576")
    names = set()
    infos = []
    for _ in range(n_tensors):
        name = c.string("tensor name")
        if name in names:
            c.fail(f"tensor {name!r} appears twice in the tensor table")
        names.add(name)
        n_dims = c.unpack("<I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            c.fail(f"tensor {name!r} has {n_dims} dimensions (expected 1 to {_MAX_DIMS})")
        dims = tuple(c.unpack("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        ttype = c.unpack("<I", f"type of tensor {name!r}")
        offset = c.unpack("<Q", f"offset of tensor {name!r}")
        try:
            qt = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise ConvertError(f"{source}: tensor {name!r} has unknown ggml type {ttype}; the file is corrupt or "
                        "from a newer llama.cpp") from None
        n = math.prod(dims)
        if any(d < 1 for d in dims) or n >= 1 << 48:
            raise ConvertError(f"{source}: tensor {name!r} has shape {list(dims)}; each dimension must be >= 1 "
                        "and the total below 2**48")
        if dims[0] % block:
            raise ConvertError(f"{source}: tensor {name!r} has a row of {dims[0]} values, not a multiple of the "
                        f"{qt.name} block size {block}")
        if offset % align:
            raise ConvertError(f"{source}: tensor {name!r} starts at offset {offset}, not a multiple of the "
                        f"alignment {align}")
        infos.append((name, dims, ttype, offset, n // block * type_size))
    data_start = c.pos + (-c.pos) % align
    scan.data_start = data_start
    for name, dims, ttype, offset, nb in infos:
        start = data_start + offset
        if start + nb > size:
            raise ConvertError(f"{source}: tensor {name!r} ({nb} bytes at {start}) ends past the end of the file "
                        f"({size} bytes); the file is truncated, download it again")
        scan.tensors.append(GGUFTensorInfo(name, dims, ttype, start, nb))
    spans = sorted(scan.tensors, key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise ConvertError(f"{source}: tensors {a.name!r} and {b.name!r} overlap in the file (bytes "
                        f"{a.offset}..{a.offset + a.n_bytes} and {b.offset}..); the file is corrupt")
    return scan


