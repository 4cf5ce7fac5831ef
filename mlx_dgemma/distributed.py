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
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import errors
from .errors import DGemmaError, ModelFilesError, ParameterError
from .launch import launched, launched_rank  # noqa: F401 (launched_rank re-exported)
from .schema import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from .acceptance import Acceptance

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
    g = _init()
    return g if g.size() > 1 else None


def _init() -> mx.distributed.Group:
    """``mx.distributed.init()``, during which SIGTERM ends the process at once.

    A ring rank whose peer already left waits in it for the connection ~30 s, and a Python
    signal handler (ours turns SIGTERM into a clean stop) runs only after that: ``mlx.launch``
    SIGTERMs the other ranks when one fails, and they must go then, not half a minute later
    (the failed rank has said why). Only the main thread can change the handler; elsewhere the
    main thread runs ours as soon as the signal comes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return mx.distributed.init()
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return mx.distributed.init()
    finally:
        signal.signal(signal.SIGTERM, old)


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


def sharded_sample_step(local: mx.array, temp: float | mx.array, acceptance: Acceptance, vocab_size: int,
                        key: mx.array, lo: int, group: mx.distributed.Group,
                        fixed: tuple[mx.array, mx.array] | None = None,
                        revealed: mx.array | None = None) -> dict[str, mx.array]:
    """``sampler.sample_step`` with the logits' vocabulary split across ranks (``acceptance``: a mode
    that runs so, :attr:`~mlx_dgemma.acceptance.Acceptance.sharded`; ``fixed``: a canvas template's
    positions, held as there; ``revealed``: the block's revealed canvas, given to the mode).

    ``local`` holds ids ``lo .. lo + local.shape[-1]``. The draw uses the same Gumbel noise as
    ``mx.random.categorical`` on the full logits (each rank generates it whole and keeps its
    columns), so it picks the same token as one process given the same logits.
    """
    from .sampler import fixed_logits, initial_revealed

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
    if fixed is not None:
        argmax = mx.where(fixed[0], fixed[1], argmax)
        entropy = mx.where(fixed[0], 0.0, entropy)
    noise = mx.random.randint(0, vocab_size, draw.shape, key=k_noise)
    revealed = revealed if revealed is not None else initial_revealed(draw.shape)
    accepted, canvas, revealed = acceptance.select(processed, argmax, entropy, lambda: draw, noise, revealed, fixed)
    if fixed is not None:
        processed = fixed_logits(processed, *fixed, lo=lo)
    return {"processed": processed, "argmax": argmax, "entropy": entropy, "accepted": accepted,
            "canvas": canvas.astype(mx.int32), "revealed": revealed}


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



# --------------------------------------------------------------------------------------------
# Agreeing on a failure: a check that one rank alone may fail


_MESSAGE_BYTES = 4096  # a longer error message is cut (it is one line)
# the start-up agreements of this process (mlx.launch): "ok" once the model is loaded on every
# rank, "failed" once one failed (no other is made then); before either, a failure is told
_startup = {"state": "pending"}


def agree(error: DGemmaError | None, group: mx.distributed.Group) -> None:
    """Every rank's outcome of a step that may fail on one rank alone (its memory check, a file
    its host lacks, its load), so that all stop together instead of leaving the others blocked
    in the next collective: returns when no rank failed, else raises on every rank, the same
    error class (the exit status and HTTP status follow it): the failing rank its own error,
    the others ``rank N: <its message>`` (the first failing rank).

    All ranks must call it at the same point, with nothing collective in between.
    Two all-reduces (the message lengths, then the messages when one is not empty)."""
    rank, n = group.rank(), group.size()
    data = f"{type(error).__name__}:{error}".encode(errors="replace")[:_MESSAGE_BYTES] if error is not None else b""
    lens = np.zeros(n, dtype=np.int32)
    lens[rank] = len(data)
    lens = np.array(_sum(mx.array(lens), group))
    if not lens.any():
        return
    width = int(lens.max())
    rows = np.zeros((n, width), dtype=np.uint8)
    rows[rank, :len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = np.array(_sum(mx.array(rows), group))
    if error is not None:
        raise error
    first = int(np.flatnonzero(lens)[0])
    name, _, message = rows[first, :lens[first]].tobytes().decode(errors="replace").partition(":")
    cls = getattr(errors, name, DGemmaError)
    cls = cls if isinstance(cls, type) and issubclass(cls, DGemmaError) else DGemmaError
    raise cls(f"rank {first}: {message}")


def _sum(a: mx.array, group: mx.distributed.Group) -> mx.array:
    out = mx.distributed.all_sum(a, group=group, stream=mx.cpu)
    mx.eval(out)
    return out


def agree_startup(error: DGemmaError | None = None, *, last: bool = False) -> None:
    """A start-up agreement point of a front end under ``mlx.launch`` (:func:`agree` in the
    launched group; nothing in one process, where ``error`` is the caller's to raise).
    ``last``: the model is loaded, the work begins: no start-up agreement follows."""
    if _startup["state"] != "pending":
        return
    group = world()
    if group is None:
        return
    try:
        agree(error, group)
    except DGemmaError:
        _startup["state"] = "failed"
        raise
    except RuntimeError as e:  # the ring broke: a rank left before its agreement (stopped, killed)
        _startup["state"] = "failed"
        raise DGemmaError(f"another rank stopped before the model was loaded on every rank ({e}); "
                          "its own line, if any, says why") from None
    if last:
        _startup["state"] = "ok"


def agree_max(value: int, error: DGemmaError | None = None) -> int:
    """The largest of the launched ranks' ``value``s, the same on every rank, once every rank
    succeeded (:func:`agree`, as a start-up agreement while the start-up is on: a rank that
    failed raises everywhere). In one process: ``value`` (or ``error`` raised).

    The memory plan's use: each rank's own precision index, the least exact wins."""
    group = world()
    if group is None:
        if error is not None:
            raise error
        return value
    if _startup["state"] == "pending":
        agree_startup(error)
    else:
        agree(error, group)
    out = mx.distributed.all_max(mx.array([value], dtype=mx.int32), group=group, stream=mx.cpu)
    mx.eval(out)
    return int(out.item())


def tell_startup_failure(error: DGemmaError) -> None:
    """This rank failed before the model was loaded everywhere (its checks, its load), outside
    an agreement point: tell the other ranks at their next one (they raise ``rank N: ...``).
    Nothing once the start-up is over (a later error is every rank's own, or agreed where it
    happens) or in one process."""
    if _startup["state"] != "pending":
        return
    try:
        agree_startup(error)
    except DGemmaError:
        pass


def startup_failed() -> bool:
    """Whether a start-up agreement failed (the ranks stop: see :func:`wait_for_rank_0`)."""
    return _startup["state"] == "failed"


def wait_for_rank_0() -> None:
    """Ranks > 0 after a failed start-up agreement: return once rank 0 has exited.

    ``mlx.launch`` SIGTERMs every other rank as soon as one exits non-zero: a rank > 0 that
    left first would cut rank 0 short before it printed the reason (the chat app, for one,
    first hands the terminal back). Rank 0 makes no collective after a failed agreement, so
    this one fails when its process ends (the ring breaks); the ring's own complaints go to
    /dev/null, this rank's one line is already out."""
    import os

    group = world()
    if group is None or group.rank() == 0:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        _sum(mx.zeros((1,), dtype=mx.int32), group)
    except Exception:  # noqa: BLE001 - the expected end: rank 0 is gone
        pass
