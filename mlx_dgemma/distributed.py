"""Tensor parallelism over MLX's distributed layer (``mx.distributed``, started by ``mlx.launch``).

Each rank holds a slice of every layer (mlx-lm's scheme, ``mlx.nn.layers.distributed``):
attention heads, the dense MLP's and every expert's hidden dimension, and the vocabulary of the
tied embedding (lookup, output head, self-conditioning's soft lookup). The router, the norms
and the per-layer scalars are replicated. A sub-layer's partial outputs are summed with one
``all_sum``; the sampler's reductions over the vocabulary (maxima, softmax normalisers,
entropy, argmax, the Gumbel-max draw) are done across ranks, so every rank ends a step with
the same canvas and takes the same decisions.

This module holds the pieces that are not model code: the group, the slices (:class:`Split`)
in module and in parameter units, reading a rank's slices straight from safetensors files, and
the sampler's cross-rank step.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import ModelFilesError, ParameterError
from .launch import launched, launched_rank  # noqa: F401 (launched_rank re-exported)
from .schema import SAFETENSORS_DTYPES

Range = tuple[int, int]


def world() -> mx.distributed.Group | None:
    """The launched group when this process is one of several ranks (``mlx.launch``), else None.

    A plain ``python -m mlx_dgemma ...`` has no group; ``mx.distributed.init()`` then gives a
    group of one, which changes nothing, so single-process runs never touch this module's paths.
    """
    if not launched():
        return None
    if not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def rank_of(group: mx.distributed.Group | None) -> int:
    return 0 if group is None else group.rank()


def size_of(group: mx.distributed.Group | None) -> int:
    return 1 if group is None else group.size()


def even(n: int, ranks: int, rank: int, what: str, unit: int = 1) -> Range:
    """Rank ``rank``'s equal part of ``n`` (``what``: named in the error when it does not divide)."""
    if n % ranks or (n // ranks) % unit:
        raise ParameterError(f"{what} = {n} cannot be split evenly over {ranks} ranks"
                             + (f" in multiples of {unit}" if unit > 1 else "")
                             + "; run with a number of ranks that divides it")
    k = n // ranks
    return rank * k, (rank + 1) * k


def vocab_range(vocab_size: int, ranks: int, rank: int) -> Range:
    """Rank ``rank``'s rows of the vocabulary (the last ranks get one fewer when it does not divide)."""
    return vocab_size * rank // ranks, vocab_size * (rank + 1) // ranks


@dataclass(frozen=True)
class Split:
    """Which part of a module's matrix a rank keeps.

    ``axis`` is ``"out"`` (rows: output features, embedding rows; for stacked experts the
    second axis) or ``"in"`` (input features, the last axis). ``ranges`` are in the module's
    logical units (unpadded features, token ids), concatenated in order: two ranges take the
    rank's part of the gate rows and of the up rows of a fused gate/up matrix.
    """

    axis: str
    ranges: tuple[Range, ...]


def param_slices(module: nn.Module, split: Split, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, list[Range]]]:
    """The split in each parameter's own units: name -> (axis, element ranges).

    ``shapes`` are the full (unsharded) parameter shapes. Quantized input splits are converted
    to packed words and scale groups; padded 16-element sub-blocks (stored twice as wide, see
    ``schema.pad_subblocks``) map feature ``f`` to stored column ``2 f``. A split that would cut
    a quantization group or a packed word is refused.
    """
    quantized = "scales" in shapes
    out: dict[str, tuple[int, list[Range]]] = {}
    for name, shape in shapes.items():
        if split.axis == "out":
            out[name] = (len(shape) - 2 if len(shape) >= 2 else 0, list(split.ranges))
            continue
        if not quantized:
            out[name] = (len(shape) - 1, list(split.ranges))
            continue
        pad = 2 if getattr(module, "subblock", 32) == 16 else 1
        gs, bits = module.group_size, module.bits
        rs: list[Range] = []
        for lo, hi in split.ranges:
            a, b = lo * pad, hi * pad  # stored columns
            if a % gs or b % gs:
                raise ParameterError(f"a split at feature {lo}..{hi} cuts a quantization group of {gs}; "
                                     "run with a number of ranks that divides the layer into whole groups")
            # packed weight: 32-bit words of 32 / bits columns; scales and biases: one per group
            rs.append((a * bits // 32, b * bits // 32) if name == "weight" else (a // gs, b // gs))
        out[name] = (len(shape) - 1, rs)
    return out


def take(a: Any, axis: int, ranges: list[Range]) -> Any:
    """The ranges of ``a`` (an mx.array or a NumPy array) along ``axis``, concatenated."""
    parts = []
    for lo, hi in ranges:
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(lo, hi)
        parts.append(a[tuple(idx)])
    if isinstance(a, mx.array):
        return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis))
    return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis))


def shard_module(module: nn.Module, split: Split) -> None:
    """Replace ``module``'s parameters by this rank's slices (``mx.contiguous`` copies, so the
    full arrays can be freed)."""
    params = dict(module.parameters())
    shapes = {k: tuple(v.shape) for k, v in params.items() if isinstance(v, mx.array)}
    for name, (axis, ranges) in param_slices(module, split, shapes).items():
        setattr(module, name, take(params[name], axis, ranges))


# --------------------------------------------------------------------------------------------
# Reading a rank's slices from the converted directory's safetensors files


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def read_sliced(path: Path, wanted: dict[str, tuple[int, list[Range]] | None]) -> dict[str, mx.array]:
    """Tensors of one safetensors file: whole (absent or ``None``) or only the given ranges along an axis.

    The file is memory-mapped and only the slice is copied out, so a rank's memory holds its
    slices, never a whole sharded tensor (a row split reads only its rows; a column split
    touches every row's pages in the page cache but copies only its columns).
    """
    header, start = _header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, mx.array] = {}
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dt = SAFETENSORS_DTYPES.get(info["dtype"])
            if dt is None:
                raise ModelFilesError(f"{path}: tensor {name}: dtype {info['dtype']} is not one a converted "
                                      "model holds; convert the model again")
            a, b = info["data_offsets"]
            arr = mm[start + a:start + b].view(dt).reshape(info["shape"])
            spec = wanted.get(name)  # a tensor the model lacks is read too: the strict load names it
            arr = np.array(arr) if spec is None else take(arr, spec[0], spec[1])
            m = mx.array(arr)
            out[name] = m.view(mx.bfloat16) if info["dtype"] == "BF16" else m
            mx.eval(out[name])
    finally:
        del mm
    return out


def load_shards(model: nn.Module, files: list[Path], full_shapes: dict[str, dict[str, tuple[int, ...]]],
                splits: dict[str, Split]) -> list[tuple[str, mx.array]]:
    """This rank's weights from ``files``: each sharded module's parameters sliced by its split.

    ``full_shapes`` holds the unsharded parameter shapes per module path (taken before
    :meth:`DiffusionGemma.shard`); ``splits`` is the model's ``shard_plan``.
    """
    modules = dict(model.named_modules())
    wanted: dict[str, tuple[int, list[Range]] | None] = {}
    for path, shapes in full_shapes.items():
        split = splits.get(path)
        slices = param_slices(modules[path], split, shapes) if split is not None else {}
        for pname in shapes:
            wanted[f"{path}.{pname}" if path else pname] = slices.get(pname)
    weights: list[tuple[str, mx.array]] = []
    for f in files:
        weights.extend(read_sliced(f, wanted).items())
    return weights


# --------------------------------------------------------------------------------------------
# The sampler across ranks: the same results as ``sampler.sample_step`` on the full logits


def global_softmax_stats(x: mx.array, group: mx.distributed.Group) -> tuple[mx.array, mx.array]:
    """The max and the sum of exp(x - max) over the vocabulary split across ranks ([..., 1] each)."""
    m = mx.distributed.all_max(mx.max(x, axis=-1, keepdims=True), group=group)
    s = mx.distributed.all_sum(mx.sum(mx.exp(x - m), axis=-1, keepdims=True), group=group)
    return m, s


def global_argmax(x: mx.array, lo: int, group: mx.distributed.Group) -> mx.array:
    """argmax over the vocabulary split across ranks (ties: the lowest id, as ``mx.argmax``)."""
    local = mx.argmax(x, axis=-1)
    best = mx.take_along_axis(x, local[..., None], axis=-1)[..., 0]
    both = mx.stack([best, (local + lo).astype(mx.float32)])  # ids < 2^24 are exact in float32
    g = mx.distributed.all_gather(both[None], group=group)  # [R, 2, ...]
    r = mx.argmax(g[:, 0], axis=0)  # the first rank holding the max = the lowest id
    return mx.take_along_axis(g[:, 1], r[None], axis=0)[0].astype(mx.int32)


def sharded_sample_step(local: mx.array, temp: float | mx.array, bound: float, vocab_size: int, key: mx.array,
                        lo: int, group: mx.distributed.Group) -> dict[str, mx.array]:
    """``sampler.sample_step`` with the logits' vocabulary split across ranks.

    ``local`` holds ids ``lo .. lo + local.shape[-1]``. The draw uses the same Gumbel noise as
    ``mx.random.categorical`` on the full logits (each rank generates it whole and keeps its
    columns), so it picks the same token as one process given the same logits.
    """
    from .sampler import accept_mask

    k_draw, k_noise = mx.random.split(key)
    processed = local / temp
    full_shape = (*processed.shape[:-1], vocab_size)
    gumbel = mx.random.gumbel(full_shape, dtype=processed.dtype, key=k_draw)[..., lo:lo + processed.shape[-1]]
    draw = global_argmax(processed + gumbel, lo, group)
    argmax = global_argmax(processed, lo, group)
    m, s = global_softmax_stats(processed, group)
    logp = processed - (m + mx.log(s))
    p = mx.exp(logp)
    entropy = -mx.distributed.all_sum(mx.sum(mx.where(p > 0, p * logp, 0.0), axis=-1), group=group)
    accepted = accept_mask(entropy, bound)
    noise = mx.random.randint(0, vocab_size, draw.shape, key=k_noise)
    canvas = mx.where(accepted, draw, noise)
    return {"processed": processed, "argmax": argmax, "entropy": entropy, "accepted": accepted,
            "canvas": canvas.astype(mx.int32)}


def all_finite(x: mx.array, group: mx.distributed.Group | None) -> mx.array:
    """Whether ``x`` is finite on every rank (one flag, the same everywhere)."""
    bad = mx.sum(~mx.isfinite(x)).astype(mx.float32)
    if group is not None:
        bad = mx.distributed.all_sum(bad, group=group)
    return bad == 0


def load_sharded_weights(model: nn.Module, files: list[Path], group: mx.distributed.Group) -> list[tuple[str, mx.array]]:
    """Shard an unloaded ``model`` for ``group`` and read this rank's slices of its weights.

    The full parameter shapes are taken before sharding (the unloaded model's arrays are lazy:
    slicing them allocates nothing); every rank reads only its part of each sharded tensor.
    """
    full = {path: {k: tuple(v.shape) for k, v in m.parameters().items() if isinstance(v, mx.array)}
            for path, m in model.named_modules()}
    full = {p: s for p, s in full.items() if s}
    plan = model.shard_plan(group.size(), group.rank())
    model.shard(group)
    return load_shards(model, files, full, plan)


def refuse_ranks(command: str) -> None:
    """One line instead of a hang: ``command`` runs in one process only."""
    g = world()
    if g is not None:
        raise ParameterError(f"{command} runs in one process, not under mlx.launch ({g.size()} ranks); "
                             "across several Macs use `mlx-dgemma generate` or `serve` (README: Several Macs)")
