"""Precisions as weight recipes, the one re-quantizer, and the bytes each precision takes.

Plain data and NumPy only (no MLX import): ``convert --precision`` writes a tier without MLX,
the runtime (:mod:`mlx_dgemma.precision`) applies the same recipe to loaded weights through the
same re-quantizer (:func:`requantize_affine`, from the integers and scales of a weight's exact
form; :func:`requantize_stored` reads them from MLX's packed arrays), and the memory plan (:mod:`mlx_dgemma.plan`) prices a precision from
the tensor inventory before a byte of weights is read.

Precisions, most exact first, each one :class:`Tier` row of :data:`TIER_ROWS` (its recipe by
role, what the plan, the loader, the converter and ``--help`` read of it; a new tier is a new row):

* ``exact``: every weight as the GGUF stores it (bit-exact; float32 K-quant scales, padded
  16-element sub-blocks).
* ``fast``: the exact integers with scales in the activation dtype; padded sub-block types
  (Q2_K, Q3_K, Q6_K) re-quantized to 8-bit groups of 32 (Q3_K and Q6_K by the pairs rule,
  :data:`PAIR_COARSER`: cheap enough for every start). On disk (``convert --precision fast``,
  formerly ``--compact``) the scales are float16. On a GPU, where the memory plan allows, the
  runtime also repacks the 5-bit legacy types (:data:`REPACK_TYPES`) into 8-bit groups with the
  same scales and biases (lossless; :func:`tensor_bytes` ``repack``); never on disk.
* ``q4`` (fits a 24 GB Mac: 14.2 GB of weights at full size) and ``q3`` (aimed at a 16 GB Mac:
  11.3 GB; under 10 GB would take 2-bit experts): weights re-quantized by role, the bits in their
  rows; groups of 128 for the experts, 64 elsewhere, or the next smaller where one does not divide
  a row (the published down projections, 704 and 2112 wide, use 64).

Why these: on real llama.cpp blocks (``benchmarks/tier_recipes.py``) affine 4-bit groups of 128
(4.25 bits per weight) give 15 % less error than ``mxfp4`` at the same 4.25 bits, and the bytes
go where they are used on every token (attention, dense MLP, head) rather than to the 128
experts of which 8 are used.

A re-quantized weight is MLX affine (``w = scale * q + bias`` per group, float16 scale and
bias) computed by :func:`requantize` from the exact float32 values: min-max ranges refined by a
least-squares refit of each group's scale and bias (lower RMS error than min-max alone); fast's
Q3_K/Q6_K groups instead from their two sub-blocks' integers (``Target.pairs``). The work is
done block by block (in the CPU's cache) and row chunk by row chunk on threads
(:func:`ordered_map`); every number depends on its group alone, so neither changes a value.
"""

from __future__ import annotations

import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from . import formats
from .packing import PER_CHUNK, chunk_type, pack_bits, unpack_bits
from .schema import unpad_subblocks


@dataclass(frozen=True)
class Tier:
    """One precision: what it stores for each weight (by role: the experts, the first and last
    layers' experts, the embedding, the rest) and what the plan, the loader, the converter and
    ``--help`` read of it. Declared once, in :data:`TIER_ROWS`."""

    name: str
    recipe: str  # one line: what it stores, for any model (--help, plan, README, a conversion's summary)
    full_size: str = ""  # the published model at full size (README, "Which Mac, which form, which command")
    lossless: bool = False  # bit-exact weights and scales, float32 activations (no --dtype)
    auto: bool = True  # ``auto`` tries it (most exact first: the rows' order)
    padded: bool = False  # the padded sub-block types re-quantized to FAST_BITS (pairs rule; the sidecar)
    repack: bool = False  # on a GPU, the 5-bit legacy types repacked to REPACK_BITS where the plan allows
    aliases: tuple[str, ...] = ()  # older names of its stored form (config.json ``mlx_dgemma.weights``)
    experts: int = 0  # bits by role (0: every weight kept as stored or by ``padded``)
    edge_experts: int = 0  # the first and last layers' experts
    embedding: int = 0  # also the output head and the self-conditioning matrix
    rest: int = 0  # attention, dense MLP, self-conditioning MLP
    experts_group: int = 128
    group: int = 64

    @property
    def help(self) -> str:
        """Its recipe and the published model's size in it (--help, plan --json)."""
        return self.recipe + self.full_size

    @property
    def requantizes(self) -> bool:
        """Its weights re-quantized by role (the memory tiers), not just their scales rounded."""
        return self.experts > 0


TIER_ROWS = (  # most exact first: ``auto`` picks the first of its rows that fits
    Tier("exact", "bit-exact weights, float32 (verify's and the parity tests' form)", lossless=True, auto=False),
    Tier("fast", "exact integers, half-precision scales, Q6_K head re-quantized to 8 bits", padded=True,
         repack=True, aliases=("compact",)),
    Tier("q4", "experts 4-bit, the rest 5-6 bits", " (14.2 GB at full size): fits a 24 GB Mac",
         experts=4, edge_experts=4, embedding=6, rest=5),
    Tier("q3", "experts 3-bit, the rest 4-6 bits", " (11.3 GB at full size): a 16 GB Mac with its GPU limit raised",
         experts=3, edge_experts=4, embedding=6, rest=4),
)
TIERS = tuple(t.name for t in TIER_ROWS)
PRECISIONS = ("auto", *TIERS)
AUTO_ORDER = tuple(t.name for t in TIER_ROWS if t.auto)  # what auto tries, most exact first
# config.json's ``mlx_dgemma.weights``: a tier, or an older name of one ("compact": fast's form)
STORED_FORMS = (*TIERS, *(a for t in TIER_ROWS for a in t.aliases))


def tier(name: str) -> Tier:
    """The row of precision ``name``; ValueError for a name that is none (``auto`` included:
    the plan resolves it)."""
    row = next((t for t in TIER_ROWS if t.name == name), None)
    if row is None:
        raise ValueError(f"unknown precision {name!r}")
    return row


# Padded sub-block types (Q2_K, Q3_K, Q6_K) in fast: 8 bits keeps their 6-bit (or fewer) values
# to within a fraction of their own step; 32 is MLX's smallest affine group.
FAST_BITS, FAST_GROUP = 8, 32
# which ggml types those are, and of them those re-quantized from their sub-blocks' integers
# (``Target.pairs``): facts of each type's row in mlx_dgemma.formats
PADDED_TYPES = formats.names(lambda t: t.padded)
PAIRED_TYPES = formats.names(lambda t: t.paired)
SCALE_DTYPE = np.float16  # scales and biases of every re-quantized weight, on disk and in memory

# fast on a GPU: the 5-bit legacy types' integers (0..31, groups of 32) repacked as 8-bit groups
# of 32 with the same scales and biases: the same dequantized values bit for bit, for 3 more bits
# a weight (which types, and why: their rows in mlx_dgemma.formats).
REPACK_TYPES = formats.names(lambda t: t.repack)
REPACK_BITS = 8


def check_precision_dtype(precision: str, dtype: str | None) -> None:
    """``exact`` is float32 by definition: another activation dtype with it is an error rather
    than a silent contradiction. By name, standard library only, so the command line refuses
    ``--precision exact --dtype bfloat16`` before it imports MLX (it took 7.8 s to say so)."""
    if precision in TIERS and tier(precision).lossless and dtype is not None and dtype != "float32":
        from .errors import ParameterError

        raise ParameterError(f"--dtype: {precision} precision runs in float32; use --precision {AUTO_ORDER[0]} "
                             "for bfloat16/float16 activations")


def stored_precision(config: dict) -> str:
    """The form a converted directory's weights are in (config.json ``mlx_dgemma.weights``,
    exact where the section or the key is absent; "compact", the older name of fast's form,
    reads as "fast"). ValueError for any other value: ``validate.check_config`` refuses those
    first, naming the file; read as exact, a lossy directory would be taken for bit-exact."""
    section = config.get("mlx_dgemma", {})
    w = section.get("weights", "exact") if isinstance(section, dict) else None
    if not (isinstance(w, str) and w in STORED_FORMS):
        raise ValueError(f"config.json mlx_dgemma.weights = {w!r}: expected one of {', '.join(TIERS)}")
    return next(t.name for t in TIER_ROWS if w in (t.name, *t.aliases))


@dataclass(frozen=True)
class Target:
    """What one weight becomes: ``bits``-bit affine groups of ``group_size`` (float16 scales).
    ``pairs``: each group is two of the source's 16-element sub-blocks, re-quantized from them
    (fast's rule for the padded types, :func:`requantize_affine`) instead of by min-max and refits."""

    bits: int
    group_size: int
    pairs: bool = False


_LAYER = re.compile(r"^layers\.(\d+)\.")


def target(precision: str, module: str, ggml_type: str, num_layers: int, width: int) -> Target | None:
    """The re-quantization target of the weight of ``module`` (an MLX module path such as
    ``layers.3.experts.gate_up_proj``) stored as ``ggml_type`` with rows of ``width`` elements,
    or None: kept as stored (``exact`` keeps everything; ``fast`` keeps all but the padded
    sub-block types). A group that does not divide the row falls back to the next smaller one
    (the published down projections are 704 and 2112 wide: groups of 64)."""
    goal = _recipe(precision, module, ggml_type, num_layers)
    if goal is None:
        return None
    group = next((g for g in (128, 64, 32) if g <= goal.group_size and width % g == 0), None)
    return None if group is None else Target(goal.bits, group, goal.pairs)


def _recipe(precision: str, module: str, ggml_type: str, num_layers: int) -> Target | None:
    if precision == "auto":
        return None
    row = tier(precision)  # ValueError for an unknown name
    if row.padded:
        return Target(FAST_BITS, FAST_GROUP, pairs=ggml_type in PAIRED_TYPES) if ggml_type in PADDED_TYPES else None
    if not row.requantizes:
        return None
    if ".experts." in module:
        m = _LAYER.match(module)
        edge = m is not None and int(m.group(1)) in (0, num_layers - 1)
        return Target(row.edge_experts if edge else row.experts, row.experts_group)
    if module == "embed_tokens":  # the output head and the self-conditioning matrix
        return Target(row.embedding, row.group)
    return Target(row.rest, row.group)


# --------------------------------------------------------------------------------------------
# the re-quantizer

# Groups re-quantized at a time (in elements): the dozen float32 passes over a block stay in the
# CPU's caches (1 MB arrays: L2/L3) instead of streaming 60 MB temporaries per pass (an 8 MB
# chunk of Q4_K input is 15 M weights), and the per-group work (a few dozen NumPy calls on
# vectors of one value a group, ~2-10 us each whatever their length) is spread over 2,048 groups
# of 128. At 1 << 16 those calls cost about as much as the passes: 1 << 18 re-quantizes the
# published expert tensors 1.5-1.7x faster (benchmarks/RESULTS.md, "The re-quantizer's blocks").
# Each group's numbers depend on that group alone, so neither this size nor the number of
# threads (:func:`ordered_map`) changes a stored value.
_BLOCK_ELEMENTS = 1 << 18
# Sub-blocks a block of fast's pairs rule (even: whole groups; 16 K sub-blocks, 256 K elements)
_PAIRS_BLOCK = 1 << 14

# fast's rule for the padded types: a group's grid is the coarser sub-block's own (that half
# stays exact) when that grid is at most this much coarser than the group's min-max grid.
# Measured on real Q6_K blocks (Gemma 3 270M) and on random ones: 1.25 lowers the relative RMS
# error 8-13 % below min-max with refits while the largest error stays within 3 % of it; a
# looser bound lowers the RMS little more and raises the largest error (benchmarks/RESULTS.md).
PAIR_COARSER = 1.15


@dataclass(frozen=True)
class Requantized:
    """A re-quantized weight in MLX's stored form, and how far it is from the exact values
    (zeros when not measured)."""

    weight: np.ndarray  # uint32, packed
    scales: np.ndarray  # float16
    biases: np.ndarray  # float16
    max_abs_error: float
    sq_error: float  # sum of squared errors (relative RMS = sqrt(sq_error / sq_exact))
    sq_exact: float


def requantize(w: np.ndarray, t: Target, measure: bool = True) -> Requantized:
    """Exact float32 rows ``[..., n]`` (sub-block padding already removed) -> ``t``'s stored form
    by min-max and least-squares refits (:func:`quantize_affine`); ``measure=False`` skips the
    error (the runtime does not report it)."""
    if t.pairs:
        raise ValueError("a pairs target re-quantizes from the sub-blocks: use requantize_affine")
    q, s, b, err = _quantize(w, t.bits, t.group_size, 2, measure)
    return _packed(q, s, b, t.bits, err)


def requantize_affine(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, subblock: int,
                      t: Target, measure: bool = True) -> Requantized:
    """The one re-quantizer, from a weight's exact affine form: ``bits``-bit integers ``q``
    ``[..., n]`` (padding removed) and float32 ``scales``/``biases`` ``[..., n/subblock]``
    (w = scale * q + bias). ``convert --precision`` (from the GGUF's blocks) and the runtime
    precisions (from a loaded weight's arrays) both call it with the same integers and scales,
    so a form loaded from a GGUF, from an exact directory or from its own converted directory
    holds the same numbers."""
    if t.pairs:
        if subblock != 16 or t.group_size != 32 or t.bits != 8:
            raise ValueError(f"pairs re-quantize 16-element sub-blocks into 8-bit groups of 32, not {t}")
        return _requantize_pairs(_columns(q), q.size // 16, scales, biases, bits, q.shape, measure)
    return requantize(dequantize(q, scales, biases, subblock), t, measure)


def requantize_stored(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
                      subblock: int, t: Target, measure: bool = False) -> Requantized:
    """:func:`requantize_affine` from a weight's stored MLX form (packed ``weight``, float
    ``scales``/``biases`` per group of ``group_size``; 16-element sub-blocks padded): what the
    runtime precisions re-quantize a loaded weight with. fast's pairs read the integers straight
    from the packed bytes; the others unpack them and form the values ``q * scale + bias``, the
    same numbers the converter forms from the GGUF's blocks."""
    lead = weight.shape[:-1]
    stored = weight.shape[-1] * 32 // bits
    n = stored // 2 if subblock == 16 else stored
    if t.pairs:
        if subblock != 16 or group_size != 32 or t.group_size != 32 or t.bits != 8:
            raise ValueError(f"pairs re-quantize 16-element sub-blocks into 8-bit groups of 32, not {t}")
        count = int(np.prod(lead, dtype=np.int64)) * n // 16
        return _requantize_pairs(_packed_columns(weight, bits), count, scales, biases, bits, (*lead, n), measure)
    return requantize(dequantize_stored(weight, scales, biases, bits, group_size, subblock), t, measure)


def quantize_affine(w: np.ndarray, bits: int, group_size: int, refits: int = 2
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows ``[..., n]`` -> (q uint8 ``[..., n]``, scales, biases ``[..., n/group]`` float16).

    Min-max range per group, then ``refits`` rounds of: round to the grid, and refit scale and
    bias by least squares to the rounded integers (each round can only lower the group's
    squared error for the chosen integers). Scales and biases are rounded to float16 *before*
    the integers are chosen, so the stored triple dequantizes to what was measured. Groups
    whose scale or bias overflows float16 raise ``OverflowError`` (the caller names the tensor).
    """
    q, s, b, _ = _quantize(w, bits, group_size, refits, measure=False)
    return q, s, b


class _Err:
    """max |stored - exact|, and the sums of squares of the error and of the exact values."""

    def __init__(self) -> None:
        self.max_abs, self.sq_error, self.sq_exact = 0.0, 0.0, 0.0

    def add(self, diff: np.ndarray, exact: np.ndarray) -> None:
        """Account a block of groups (rows): ``diff`` (float32) against ``exact``."""
        self.max_abs = max(self.max_abs, float(diff.max(initial=0.0)), -float(diff.min(initial=0.0)))
        # each group's sum in float32, the groups' in float64: the figures to ~7 digits
        self.sq_error += float(np.einsum("ij,ij->i", diff, diff).sum(dtype=np.float64))
        self.sq_exact += float(np.einsum("ij,ij->i", exact, exact).sum(dtype=np.float64))


def _packed(q: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, err: _Err | None) -> Requantized:
    e = err or _Err()
    return Requantized(pack_bits(q, bits), s, b, e.max_abs, e.sq_error, e.sq_exact)


def _quantize(w: np.ndarray, bits: int, group_size: int, refits: int, measure: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Err | None]:
    """:func:`quantize_affine` block by block, and (``measure``) its error."""
    levels = (1 << bits) - 1
    shape = w.shape
    g_all = np.asarray(w, dtype=np.float32).reshape(-1, group_size)  # one group a row
    groups = g_all.shape[0]
    q = np.empty(g_all.shape, dtype=np.uint8)
    scales, biases = np.empty(groups, dtype=SCALE_DTYPE), np.empty(groups, dtype=SCALE_DTYPE)
    block = max(1, _BLOCK_ELEMENTS // group_size)
    buf, tmp = np.empty((block, group_size), np.float32), np.empty((block, group_size), np.float32)
    err = _Err() if measure else None
    n = group_size
    ones = np.ones(n, np.float32)
    exact_sums = n * levels * levels < 1 << 24
    with np.errstate(over="ignore"):  # a float16 overflow is _half's error, not a warning
        for i in range(0, groups, block):
            _quantize_block(g_all[i:i + block], buf, tmp, levels, refits, ones, exact_sums, q[i:i + block],
                            scales[i:i + block], biases[i:i + block], err)
    return q.reshape(shape), scales.reshape(*shape[:-1], -1), biases.reshape(*shape[:-1], -1), err


def _quantize_block(g: np.ndarray, buf: np.ndarray, tmp: np.ndarray, levels: int, refits: int, ones: np.ndarray,
                    exact_sums: bool, q: np.ndarray, scales: np.ndarray, biases: np.ndarray, err: _Err | None
                    ) -> None:
    """One block of :func:`_quantize`: groups ``g`` [k, group] -> ``q``, ``scales``, ``biases``
    (``buf``, ``tmp``: float32 scratch of at least ``g``'s shape)."""
    n = g.shape[1]
    qf, t = buf[:g.shape[0]], tmp[:g.shape[0]]
    lo, hi = g.min(-1), g.max(-1)
    scale, bias = _half((hi - lo) / levels), _half(lo)
    s32, b32 = scale.astype(np.float32), bias.astype(np.float32)
    _round_to_grid(g, s32, b32, levels, qf)
    sw = g.sum(-1)
    for _ in range(refits):
        # sums of integers below 2**24 are exact in float32 in any order (BLAS, einsum);
        # sum(q * w) is not, and keeps NumPy's pairwise order: the plain formula's numbers
        # (tests/test_tiers.py), bit for bit
        if exact_sums:
            sq, sqq = qf @ ones, np.einsum("ij,ij->i", qf, qf)
        else:
            sq, sqq = qf.sum(-1), np.multiply(qf, qf, out=t).sum(-1)
        sqw = np.multiply(qf, g, out=t).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = np.where(ok, det, 1)
        new_s = np.where(ok, (n * sqw - sq * sw) / safe, s32)
        new_b = np.where(ok, (sw - new_s * sq) / n, b32)
        scale, bias = _half(new_s), _half(new_b)
        s32, b32 = scale.astype(np.float32), bias.astype(np.float32)
        _round_to_grid(g, s32, b32, levels, qf)
    q[...] = qf
    scales[...], biases[...] = scale, bias
    if err is not None:
        np.multiply(qf, s32[:, None], out=t)
        np.add(t, b32[:, None], out=t)
        err.add(np.subtract(t, g, out=t), g)


def _requantize_pairs(columns: Callable[[int, int], np.ndarray], count: int, scales: np.ndarray,
                      biases: np.ndarray, bits: int, shape: tuple[int, ...], measure: bool) -> Requantized:
    """fast's form of a padded type: ``count`` 16-element sub-blocks of ``bits``-bit integers
    (``columns(m0, m1)``: those of sub-blocks m0..m1 as the columns of a [16, m1 - m0] uint8
    array; scales and biases float32, one each a sub-block) -> 8-bit groups of 32, each group
    two consecutive sub-blocks, in rows ``shape`` [..., n] of elements.

    Where it costs little (:data:`PAIR_COARSER`), a group's grid is the coarser sub-block's own
    steps subdivided (6-bit: 4 grid steps to one of its steps) and shifted by whole steps to
    cover the other sub-block: that half of the group stays exact (up to its float16 scale and
    offset) and only the other half is rounded. Elsewhere the group's min-max grid. No refits
    and no float copy of the weight: O(groups) work and a few passes over the integers, done
    sub-block-major (16 rows of long vectors, where NumPy is fast, not millions of rows of 16)."""
    levels = (1 << bits) - 1
    sub_steps = 255 // levels  # grid steps per step of a sub-block (6-bit: 4)
    sc, bi = (np.asarray(a, dtype=np.float32).reshape(-1) for a in (scales, biases))
    out = np.empty((count, 16), dtype=np.uint8)
    s_out, b_out = np.empty(count // 2, dtype=SCALE_DTYPE), np.empty(count // 2, dtype=SCALE_DTYPE)
    block = _PAIRS_BLOCK
    err = _Err() if measure else None
    with np.errstate(over="ignore"):  # a float16 overflow is _half's error, not a warning
        for m0 in range(0, count, block):
            m1 = min(count, m0 + block)
            qt = columns(m0, m1)
            s, b = sc[m0:m1], bi[m0:m1]
            # each sub-block's value range from its integers' range (w is monotone in q)
            ends = (b + qt.min(0).astype(np.float32) * s, b + qt.max(0).astype(np.float32) * s)
            lo_j, hi_j = np.minimum(*ends), np.maximum(*ends)
            lo, hi = np.minimum(lo_j[0::2], lo_j[1::2]), np.maximum(hi_j[0::2], hi_j[1::2])
            minmax = (hi - lo) / 255
            first = np.abs(s[0::2]) >= np.abs(s[1::2])  # the coarser sub-block (the first on a tie)
            step = np.abs(np.where(first, s[0::2], s[1::2])) / sub_steps
            base = np.where(first, lo_j[0::2], lo_j[1::2])
            start = base - np.ceil(np.maximum(base - lo, 0) / np.where(step == 0, 1, step)) * step
            own = (step > 0) & (start + 255 * step >= hi) & (step <= PAIR_COARSER * minmax)
            scale, bias = _half(np.where(own, step, minmax)), _half(np.where(own, start, lo))
            sf, bf = np.repeat(scale.astype(np.float32), 2), np.repeat(bias.astype(np.float32), 2)
            safe = np.where(sf == 0, 1, sf)
            # (q * s + b - bias) / scale, per sub-block: q * (s / scale) + (b - bias) / scale
            x = qt.astype(np.float32)
            np.multiply(x, s / safe, out=x)
            np.add(x, (b - bf) / safe, out=x)
            np.rint(x, out=x)
            np.clip(x, 0, 255, out=x)
            out[m0:m1] = x.astype(np.uint8).T  # transposed as bytes: 4x less to move than floats
            s_out[m0 // 2:m1 // 2], b_out[m0 // 2:m1 // 2] = scale, bias
            if err is not None:
                exact = qt * s
                exact += b
                np.multiply(x, sf, out=x)
                np.add(x, bf, out=x)
                err.add(np.subtract(x, exact, out=x).reshape(-1, 16), exact.reshape(-1, 16))
    lead = shape[:-1]
    return _packed(out.reshape(shape), s_out.reshape(*lead, -1), b_out.reshape(*lead, -1), 8, err)


def _columns(q: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """Unpacked integers ``[..., n]`` as :func:`_requantize_pairs` reads them (sub-blocks of 16)."""
    rows = q.reshape(-1, 16)
    return lambda m0, m1: np.ascontiguousarray(rows[m0:m1].T)


def _packed_columns(weight: np.ndarray, bits: int) -> Callable[[int, int], np.ndarray]:
    """MLX's padded form of a 16-element sub-block type (each sub-block a 32-element group whose
    second half is padding) as :func:`_requantize_pairs` reads it: the real half's bytes,
    transposed, then unpacked row by row (long vectors) in MLX's LSB-first layout."""
    raw = np.ascontiguousarray(weight).view(np.uint8).reshape(-1, 4 * bits)  # 32 elements a group
    per = PER_CHUNK[bits]
    nbytes = per * bits // 8
    acc_t = chunk_type(nbytes)
    mask = acc_t((1 << bits) - 1)

    def columns(m0: int, m1: int) -> np.ndarray:
        by = np.ascontiguousarray(raw[m0:m1, :2 * bits].T)  # the 16 real elements' bytes, transposed
        out = np.empty((16, m1 - m0), dtype=np.uint8)
        for c in range(16 // per):
            acc = by[c * nbytes].astype(acc_t)
            for i in range(1, nbytes):
                acc |= by[c * nbytes + i].astype(acc_t) << acc_t(8 * i)
            for i in range(per):
                np.bitwise_and(acc >> acc_t(bits * i), mask, out=out[c * per + i], casting="unsafe")
        return out

    return columns


def _half(x: np.ndarray) -> np.ndarray:
    """``x`` in float16, or OverflowError (callers hold ``np.errstate(over="ignore")``)."""
    h = x.astype(SCALE_DTYPE)
    if not np.isfinite(h).all():
        raise OverflowError(f"a group's scale or offset exceeds float16's range (max |value| "
                            f"{float(np.abs(x).max()):.3g})")
    return h


def _round_to_grid(g: np.ndarray, scale: np.ndarray, bias: np.ndarray, levels: int, out: np.ndarray) -> None:
    """``out`` (float32, shaped like ``g`` [groups, group]) = each value's grid index in [0, levels]
    (``scale``, ``bias``: float32 [groups], float16 values)."""
    np.subtract(g, bias[:, None], out=out)
    np.divide(out, np.where(scale == 0, np.float32(1), scale)[:, None], out=out)
    np.rint(out, out=out)
    np.clip(out, 0, levels, out=out)


def dequantize(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int) -> np.ndarray:
    """Inverse of :func:`quantize_affine` (unpacked integers), float32."""
    g = q.reshape(*q.shape[:-1], -1, group_size).astype(np.float32)
    g *= scales.astype(np.float32)[..., None]
    g += biases.astype(np.float32)[..., None]
    return g.reshape(q.shape)


def dequantize_stored(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                      group_size: int = 32, subblock: int = 32) -> np.ndarray:
    """A stored (packed, possibly padded) affine weight -> float32 values, padding dropped."""
    q = unpack_bits(weight, bits)
    return unpad_subblocks(dequantize(q, scales, biases, group_size), subblock)


def workers() -> int:
    """Threads for the re-quantizer: the processors this process may run on (NumPy's array
    operations release the GIL, so threads share the work without copies)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], threads: int | None = None) -> Iterator[Any]:
    """``map(fn, items)`` on ``threads`` threads (default :func:`workers`), results in order, at
    most two per thread in flight (bounded memory). Deterministic: each result depends on its
    item alone; an exception is raised where its item's result would have been."""
    n = workers() if threads is None else threads
    if n <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(n, thread_name_prefix="requantize")
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * n:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# bytes of a precision, from the tensor inventory alone


@dataclass(frozen=True)
class TensorInfo:
    """One weight of the inventory: MLX module path (parameter path for float tensors), logical
    shape in MLX order (last axis = row), ggml type as stored in the GGUF."""

    module: str
    shape: tuple[int, ...]
    ggml_type: str



def repacked(precision: str, ggml_type: str | None) -> bool:
    """Whether ``precision``'s runtime form on a GPU repacks a weight stored as ``ggml_type``
    into :data:`REPACK_BITS`-bit groups (:data:`REPACK_TYPES`; fast only, when the plan allows)."""
    return precision == "fast" and ggml_type in REPACK_TYPES


def tensor_bytes(info: TensorInfo, precision: str, num_layers: int, scale_bytes: int = 2,
                 float_bytes: int | None = None, repack: bool = False) -> int:
    """Bytes ``precision`` holds for one weight. ``scale_bytes``: the itemsize of fast's scales
    (2 on a GPU, 4 on MLX's CPU backend, 2 on disk); ``float_bytes``: the itemsize float tensors
    are held in (None: as stored); ``repack``: fast's 5-bit legacy types held repacked at 8 bits
    (the runtime's form on a GPU, :func:`repacked`)."""
    n = int(np.prod(info.shape))
    fmt = formats.lookup(info.ggml_type)  # bits, sub-blocks and scales of its exact form
    if not fmt.quantized:
        return n * (float_bytes or fmt.float_bytes)
    t = target(precision, info.module, info.ggml_type, num_layers, info.shape[-1])
    if t is not None:
        return n * t.bits // 8 + 2 * (n // t.group_size) * np.dtype(SCALE_DTYPE).itemsize
    bits = REPACK_BITS if repack and repacked(precision, info.ggml_type) else fmt.bits
    stored = n * (2 if fmt.padded else 1)
    if precision == "exact":
        sb = 4 if fmt.float32_scales else 2  # the legacy types' scales are exact in float16
    else:
        sb = scale_bytes
    return stored * bits // 8 + 2 * (stored // 32) * sb


def weight_bytes(inventory: Iterable[TensorInfo], precision: str, num_layers: int, scale_bytes: int = 2,
                 float_bytes: int | None = None, repack: bool = False) -> int:
    """Bytes of all weights in ``precision`` (see :func:`tensor_bytes`)."""
    return sum(tensor_bytes(i, precision, num_layers, scale_bytes, float_bytes, repack) for i in inventory)
