"""A DiffusionGemma GGUF opened once, for both of its consumers.

:class:`GGUFSource` validates the file (bounded pre-scan, metadata, tensor inventory) when it
is opened, then holds what a model directory is made of: the model's shape
(:class:`mlx_dgemma.schema.ModelArgs`), the generation defaults, the tokenizer data and chat
template, and the tensors, converted one at a time into MLX names, NumPy arrays and a
:class:`mlx_dgemma.schema.QuantSpec`. ``convert()`` writes a source to disk; the core's
``load_gguf`` turns it into MLX arrays in memory.

Tensor bytes are read with ``read`` through the source's own file handle, not through the
memory map: a file cut short by another process then gives an error naming it, not SIGBUS.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mlx_dgemma.errors import NonFiniteError
from mlx_dgemma.paths import check_gguf_input, user_path
from mlx_dgemma.schema import ModelArgs, QuantSpec

from .errors import ConvertError
from .header import GGUFHeader
from .metadata import (ARCH, args_from_metadata, array_len, check_args, check_gguf_metadata, field_kinds, field_value,
                       generation_config, partial_rotary_factor, read_metadata)
from .names import mlx_name, module_path, stored_names
from .quants import FLOAT_TYPES
from .scan import scan_gguf
from .tensors import Converted, check_inventory, convert_tensor

FORMAT_VERSION = 1
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges")

# (bytes done, bytes in all, tensors done, tensors in all, GGUF name of the last one)
Progress = Callable[[int, int, int, int, str], None]


class GGUFSource:
    """A DiffusionGemma GGUF, opened and validated once; use it as a context manager (or call
    :meth:`close`) to release its file handle.

    ``path`` (``~`` and ``$VARS`` expanded), ``reader`` (gguf-py, memory-mapped),
    ``metadata`` (plain Python values, long arrays summarized) and ``args`` (the model's shape)
    are set on opening; everything else is read when first asked for.
    """

    def __init__(self, path: str | Path, architecture: str = ARCH):
        self.path = user_path(path)
        self.reader = open_gguf(self.path, architecture)
        self.metadata, self.args = model_metadata(self.reader, str(self.path))
        self._file = open(self.path, "rb")
        self._lock = threading.Lock()
        self._stat = os.fstat(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "GGUFSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the model directory's side files hold -------------------------------------------

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json: the sampler defaults, with the GGUF's ``diffusion.eb_*`` keys."""
        return generation_config(self.metadata)

    @cached_property
    def tokenizer(self) -> dict[str, Any]:
        """Everything the tokenizer needs, as stored in the GGUF (raw, so it rebuilds exactly)."""
        return tokenizer_payload(self.reader)

    @cached_property
    def chat_template(self) -> str | None:
        """The GGUF's Jinja chat template, if it has one."""
        if "tokenizer.chat_template" not in self.reader:
            return None
        return str(field_value(self.reader, "tokenizer.chat_template"))

    def config(self, specs: dict[str, QuantSpec], precision: str = "exact") -> dict[str, Any]:
        """config.json, given the specs the converted tensors came with (module path -> spec)
        and the precision they were converted to."""
        return model_config(self.metadata, self.args, specs, precision, str(self.path))

    # -- the tensors ---------------------------------------------------------------------------

    @property
    def n_bytes(self) -> int:
        """Bytes of tensor data in the GGUF."""
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def inventory(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(MLX module path of a quantized weight, or parameter path of a float one; shape in MLX
        order; ggml type name) of every tensor, from the header alone (the memory plan's input)."""
        out = []
        for t in self.reader.tensors:
            path = mlx_name(t.name)
            quantized = t.tensor_type not in FLOAT_TYPES
            out.append((module_path(path) if quantized else path, tuple(int(x) for x in reversed(t.shape)),
                        t.tensor_type.name))
        return out

    def stored_names(self) -> list[str]:
        """Every MLX array name the converted tensors will have, in order (before converting)."""
        return [n for t in self.reader.tensors
                for n in stored_names(mlx_name(t.name), quantized=t.tensor_type not in FLOAT_TYPES)]

    def tensors(self, precision: str = "exact", progress: Progress | None = None) -> Iterator[Converted]:
        """Each tensor converted to ``precision`` (``mlx_dgemma.tiers``; "exact" is bit-exact),
        one at a time, in file order.

        Each tensor's parts read its rows from the file as the consumer takes them (see
        :func:`~.tensors.convert_tensor`), so a streaming consumer holds a chunk, not the tensor.
        ``progress`` is called once a consumer has taken a tensor; then any pages of it in the
        memory map are dropped too.
        """
        tensors = list(self.reader.tensors)
        total, done = self.n_bytes, 0
        for i, t in enumerate(tensors):
            try:
                c = convert_tensor(self._read(t), precision, self.args.num_hidden_layers)
            except NonFiniteError as e:  # name the file too
                raise NonFiniteError(f"{self.path}: {e}") from None
            for part in c.parts.values():  # the parts are produced (and checked) as they are consumed
                part.produce = self._naming_file(part.produce)
            if c.prepare is not None:
                prepare = c.prepare
                c.prepare = lambda prepare=prepare: list(self._naming_file(lambda: iter([prepare()]))())
            yield c
            del c
            done += int(t.n_bytes)
            release_pages(self.reader, t)
            if progress:
                progress(done, total, i + 1, len(tensors), t.name)
        self.check_unchanged()

    def _naming_file(self, produce: Callable[[], Iterator[np.ndarray]]) -> Callable[[], Iterator[np.ndarray]]:
        """``produce`` with its NaN/Inf errors naming the file too."""
        def named() -> Iterator[np.ndarray]:
            try:
                yield from produce()
            except NonFiniteError as e:
                raise NonFiniteError(f"{self.path}: {e}") from None
        return named

    def check_unchanged(self) -> None:
        """The file still has the size and time it had when opened (another process may write it)."""
        now = os.fstat(self._file.fileno())
        if (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            raise ConvertError(f"{self.path}: the file changed during conversion (size {self._stat.st_size} -> "
                               f"{now.st_size}); nothing was kept, convert again once the file is complete")

    def _read(self, t) -> "_ReadTensor":
        """``t`` with a row reader: its rows are read from the file when the converter asks for
        them (explicit reads, not the memory map: a file cut short is an error, not a SIGBUS, and
        nothing of the input stays resident beyond the chunk being repacked)."""
        off, n = int(t.data_offset), int(t.n_bytes)
        ne = [int(x) for x in t.shape]
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        row_bytes = n // rows

        def read_rows(r0: int, r1: int) -> np.ndarray:
            want = (r1 - r0) * row_bytes
            buf = np.empty(want, dtype=np.uint8)
            view, got = memoryview(buf), 0
            with self._lock:  # the re-quantizer's threads read chunks of one tensor
                self._file.seek(off + r0 * row_bytes)
                while got < want:
                    k = self._file.readinto(view[got:])
                    if not k:
                        raise ConvertError(f"{self.path}: the file changed during conversion (tensor {t.name!r} "
                                           f"ends at byte {off + n}, the file now has "
                                           f"{os.fstat(self._file.fileno()).st_size}); "
                                           "nothing was kept, convert again once the file is complete")
                    got += k
            return buf.reshape(r1 - r0, row_bytes)

        return _ReadTensor(t.name, t.shape, t.tensor_type, t.n_bytes, t.data_offset, read_rows)


@dataclass
class _ReadTensor:
    """A gguf-py tensor whose rows are read from the file on demand (what ``convert_tensor`` needs)."""

    name: str
    shape: Any
    tensor_type: Any
    n_bytes: int
    data_offset: int
    read_rows: Callable[[int, int], np.ndarray]


def check_input_file(src: Path) -> None:
    """The input must be a readable regular file (not a directory, FIFO, device or link loop)."""
    check_gguf_input(src, ConvertError)


def open_gguf(path: Path, architecture: str | None = ARCH) -> GGUFHeader:
    """Open a GGUF memory-mapped, turning failures into one-line errors. A file of another
    ``architecture`` is refused from its first metadata key; ``architecture=None`` opens any
    GGUF. The bounded pre-scan checks every count against the file and records where each value
    lies; the header decodes values from there when asked (not gguf-py's reader: it builds a
    view per vocabulary item, 18-33 s for the published model; see :mod:`.header`)."""
    path = user_path(path)
    check_input_file(path)
    scan = scan_gguf(path, architecture)
    try:
        return GGUFHeader(path, scan)
    except (ValueError, OSError) as e:
        raise ConvertError(f"{path}: cannot map the GGUF ({e}); the file is truncated or corrupt, "
                           "download it again") from e


def model_metadata(reader: GGUFHeader, source: str) -> tuple[dict, ModelArgs]:
    """Metadata dict and the model's shape, with the RoPE split read from ``rope_freqs``;
    the tensor inventory is checked against it."""
    md = read_metadata(reader)
    check_gguf_metadata(md, field_kinds(reader), source)
    vocab = array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ConvertError(f"{source}: no tokenizer.ggml.tokens and no token_embd.weight; "
                               "cannot tell the vocabulary size")
        vocab = int(embd.shape[1])
    rope = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    factor = partial_rotary_factor(np.asarray(rope.data), source) if rope is not None else 0.25
    cfg = args_from_metadata(md, vocab, source=source, partial_rotary_factor=factor)
    check_args(md, cfg, source)
    check_inventory(reader, cfg, source)
    return md, cfg


def model_config(md: dict, cfg: ModelArgs, specs: dict[str, QuantSpec], precision: str, source: str) -> dict:
    """config.json: a diffusion_gemma config plus a per-tensor ``quantization`` section."""
    bits = Counter(s.bits for s in specs.values()).most_common(1)
    quant = {"group_size": 32, "bits": bits[0][0] if bits else 4, "mode": "affine",
             **{k: s.to_dict() for k, s in specs.items()}}
    return {
        "model_type": "diffusion_gemma",
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "canvas_length": cfg.canvas_length,
        "mask_token_id": cfg.mask_token_id,
        "tie_word_embeddings": True,
        "text_config": cfg.to_dict(),
        "quantization": quant,
        "mlx_dgemma": {"format_version": FORMAT_VERSION, "weights": precision,
                       "source": Path(source).name, "ggml_file_type": md.get("general.file_type"),
                       "general.name": md.get("general.name")},
    }


def tokenizer_payload(reader: GGUFHeader) -> dict:
    """Everything the tokenizer needs, as stored in the GGUF (raw, so it rebuilds exactly)."""
    out = {}
    for k in reader.keys():
        if k.startswith("tokenizer.") and k != "tokenizer.chat_template":
            out[k] = field_value(reader, k, full=k in _TOKENIZER_ARRAYS)
    return out


def release_pages(reader: GGUFHeader, t) -> None:
    """Drop a converted tensor's pages from the memory map, so the resident set stays at about
    one tensor instead of growing with everything read (the pages are file-backed: dropping
    them costs nothing but a re-read if touched again)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = (int(t.data_offset) // page) * page
    end = int(t.data_offset) + int(t.n_bytes)
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # best effort: some platforms refuse it on shared maps
        pass
