"""Streaming safetensors shards: bounded memory, header written last into reserved space; and
the shards read back, memory-mapped."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from mlx_dgemma.schema import SAFETENSORS_DTYPES, STORED_DTYPES
from mlx_dgemma.validate import check_safetensors

from .errors import ConvertError

from .tensors import Part

# a stored array's dtype -> its tag (uint16 arrays are bfloat16 payloads: STORED_DTYPES has no U16)
_TAGS = {SAFETENSORS_DTYPES[tag]: tag for tag in STORED_DTYPES}


def st_dtype(a: np.ndarray) -> str:
    """safetensors dtype tag; uint16 arrays are bfloat16 payloads (see tensors.BF16Payload)."""
    return _TAGS[a.dtype]


class ShardWriter:
    """Writes one safetensors file tensor by tensor.

    safetensors offsets are relative to the end of the header, so the data can be streamed
    before the header is known: ``reserve`` bytes are left for it and padded with spaces (the
    format allows trailing whitespace in the header).
    """

    def __init__(self, path: Path, reserve: int):
        self.path = path
        self.reserve = reserve + (-reserve) % 8  # keep the data 8-byte aligned
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self._f = open(path, "wb")
        self._f.seek(8 + self.reserve)

    def add(self, name: str, a: np.ndarray | Part) -> None:
        """Append an array, or a :class:`~.tensors.Part` chunk by chunk (its whole never in memory)."""
        if isinstance(a, np.ndarray):
            shape, chunks = list(a.shape), iter([a])
        else:
            shape, chunks = list(a.shape), a.chunks()
        n, tag = 0, None
        for c in chunks:
            c = np.ascontiguousarray(c)
            self._f.write(memoryview(c.reshape(-1).view(np.uint8)))
            n, tag = n + c.nbytes, st_dtype(c)
        self.entries[name] = {"dtype": tag, "shape": shape, "data_offsets": [self.offset, self.offset + n]}
        self.offset += n

    def close(self) -> None:
        header = json.dumps({"__metadata__": {"format": "mlx"}, **self.entries},
                            separators=(",", ":")).encode()
        if len(header) > self.reserve:  # pragma: no cover - reserve is an upper bound
            raise RuntimeError(f"safetensors header of {self.path} exceeds its reserved space")
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self.reserve))
        self._f.write(header + b" " * (self.reserve - len(header)))
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def header_reserve(names: list[str], max_dims: int = 4) -> int:
    """Upper bound of a header listing ``names`` (largest shapes and offsets assumed)."""
    per = len('"":{"dtype":"BF16","shape":[],"data_offsets":[,]},') + max_dims * 17 + 2 * 16
    return 64 + sum(len(n) + per for n in names)


def write_index(out: Path, weight_map: dict[str, str], total: int) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def finalize_shard_names(out: Path, files: list[Path], weight_map: dict[str, str]) -> None:
    """Rename shard-N.tmp files to the hub-style model-0000i-of-0000n.safetensors names."""
    n = len(files)
    renames = {}
    for i, f in enumerate(files, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        os.replace(f, out / final)
        renames[f.name] = final
    for k, v in weight_map.items():
        weight_map[k] = renames[v]


class StoredRows:
    """One stored array, read a slice of its leading axis at a time (``rows[i:j]``, a new
    array). Unlike a memory map's, the pages read do not stay in the process's resident memory:
    the converter reads its own output back (fast's sidecar) within its memory bound."""

    def __init__(self, path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.path, self.offset, self.dtype, self.shape = path, offset, dtype, tuple(shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("StoredRows reads contiguous rows only")
        per = int(np.prod(self.shape[1:], dtype=np.int64))
        count = max(0, stop - start) * per
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * per * self.dtype.itemsize)
            a = np.fromfile(f, dtype=self.dtype, count=count)
        if a.size != count:
            raise ConvertError(f"{self.path}: shorter than its header says; convert the model again")
        return a.reshape(-1, *self.shape[1:])


def open_safetensors(path: Path, rows: bool = False) -> dict[str, np.ndarray]:
    """Memory-mapped arrays of one safetensors file (bfloat16 stays raw uint16); with ``rows``,
    :class:`StoredRows` instead (read on demand, not mapped)."""
    header = check_safetensors(path)  # bounded, typed, inside the file
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    out = {}
    for name, e in header.items():
        if e["dtype"] not in STORED_DTYPES:
            raise ConvertError(f"{path}: tensor {name!r} has dtype {e['dtype']}, which mlx-dgemma never "
                               "writes; convert the model again")
        dtype = SAFETENSORS_DTYPES[e["dtype"]]
        a, b = e["data_offsets"]
        count = (b - a) // dtype.itemsize
        if rows and e["shape"]:
            out[name] = StoredRows(path, 8 + n + a, dtype, e["shape"])
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + a, shape=(count,)).reshape(e["shape"])
    return out
