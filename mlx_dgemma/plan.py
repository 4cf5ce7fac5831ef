"""A memory plan before loading: what each precision needs, and what this device can give.

For every precision: the weights (priced from the tensor inventory alone by
:func:`mlx_dgemma.tiers.weight_bytes`: no weight is read), the KV cache for the requested
context, and the working memory of a step (the canvas's logits, self-conditioning, attention)
from :mod:`mlx_dgemma.memory`; plus what loading itself holds at its peak (a tier made at load
time from an exact *directory* holds the exact weights first; from a GGUF it is re-quantized
tensor by tensor). Compared with the device's budget (:func:`mlx_dgemma.memory.device_budget`)
or a user's ``--memory-limit``.

``auto`` picks the most exact form that fits, starting at ``fast`` (``exact``'s float32 is for
verification and parity, not for running); a precision that does not fit is refused before any
weight is read, with one line naming what would fit.

Under ``mlx.launch`` (or ``plan --ranks N``) a plan prices one rank's share: each sharded
tensor cut to its slice by the model's own ``shard_plan`` (:class:`mlx_dgemma.distributed.Split`),
the replicated ones whole, the KV cache of this rank's key/value heads, and the working memory
of its heads and hidden slices. ``auto`` then takes the most exact form that *every* rank holds
(:func:`choose_across_ranks`), so the ranks load the same precision and their collectives match.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any

from .distributed import Split, param_slices
from .errors import DGemmaError, MemoryBudgetError, ParameterError
from .memory import device_budget, estimate, gb
from .schema import ModelArgs
from .tiers import TIER_HELP, TIERS, TensorInfo, weight_bytes

DEFAULT_CONTEXT = 4096  # tokens the plan reserves KV cache for (prompt, history and answer)
AUTO_ORDER = ("fast", "q4", "q3")  # what auto tries, most exact first


@dataclass(frozen=True)
class PlanRow:
    """One precision: bytes it needs once loaded and while loading, and whether it fits."""

    precision: str
    weights_bytes: int
    kv_bytes: int
    working_bytes: int
    load_peak_bytes: int  # while loading (the exact form first, for a tier made from an exact directory)
    loadable: bool  # the stored form can become this precision (never more exact than stored)
    fits: bool
    split_refused: bool = False  # several ranks: quantized whole before the split, whose groups it would cut

    @property
    def needed_bytes(self) -> int:
        return max(self.weights_bytes + self.kv_bytes + self.working_bytes, self.load_peak_bytes)


@dataclass(frozen=True)
class Plan:
    """Every precision's needs for one model, against one budget."""

    model: str
    stored: str  # the form on disk: "gguf" for a .gguf, else the directory's precision
    context_tokens: int
    available_bytes: int
    budget: str  # where the budget comes from ("Metal's recommended working set", "--memory-limit", ...)
    rows: tuple[PlanRow, ...]
    ranks: int = 1  # the figures are rank ``rank``'s share of a model split over ``ranks`` (mlx.launch)
    rank: int = 0

    def row(self, precision: str) -> PlanRow:
        return next(r for r in self.rows if r.precision == precision)

    def best_fit(self, candidates: tuple[str, ...] = AUTO_ORDER) -> str | None:
        """The most exact of ``candidates`` that is loadable and fits, or None."""
        return next((r.precision for r in self.rows if r.precision in candidates and r.loadable and r.fits), None)

    def choose(self, requested: str) -> str:
        """The precision to load: ``requested``, or for ``auto`` the most exact that fits.
        Raises :class:`MemoryBudgetError` (one line) when it does not fit."""
        if requested == "auto":
            stored = self.stored if self.stored in AUTO_ORDER else "fast"
            choice = self.best_fit(AUTO_ORDER[AUTO_ORDER.index(stored):])
            if choice is None:
                if self.row(stored).split_refused:
                    raise ParameterError(self.split_refusal(stored))
                raise MemoryBudgetError(self.refusal(stored))
            return choice
        row = self.row(requested)
        if row.split_refused:
            raise ParameterError(self.split_refusal(requested))
        if row.loadable and not row.fits:
            raise MemoryBudgetError(self.refusal(requested))
        return requested

    def refusal(self, precision: str) -> str:
        """One line: what ``precision`` needs against what is available, what would fit, and
        on macOS how to raise the GPU's limit (and its risk)."""
        r = self.row(precision)
        fit = self.best_fit(tuple(p for p in TIERS if TIERS.index(p) > TIERS.index(precision)))
        what = (f"--precision {fit} fits ({gb(self.row(fit).needed_bytes)})" if fit is not None
                else "no precision fits")
        where = f" on rank {self.rank} of {self.ranks} (its share)" if self.ranks > 1 else ""
        line = (f"{self.model}: --precision {precision} needs about {gb(r.needed_bytes)}{where} (weights "
                f"{gb(r.weights_bytes)}, KV cache {gb(r.kv_bytes)} for {self.context_tokens} tokens, working "
                f"{gb(r.working_bytes)}) but {gb(self.available_bytes)} is available ({self.budget}); {what}")
        if sys.platform == "darwin" and "Metal" in self.budget:
            mb = math.ceil((r.needed_bytes + (1 << 30)) / 2**20)
            line += (f"; or raise the GPU's limit with `sudo sysctl iogpu.wired_limit_mb={mb}` (until reboot; "
                     "it leaves less memory to macOS and other apps, too high a value can freeze the Mac)")
        return line

    def split_refusal(self, precision: str) -> str:
        """One line: ``precision`` is quantized before the split, in groups the split would cut."""
        where = "stored so in this directory" if self.stored != "gguf" else "made whole from the .gguf"
        return (f"{self.model}: --precision {precision} is {where}, in quantization groups that do not split "
                f"over {self.ranks} ranks; give the ranks a directory converted with --precision exact or fast "
                f"(each rank re-quantizes its own slices to {precision})")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "stored": self.stored, "ranks": self.ranks, "rank": self.rank,
                "context_tokens": self.context_tokens,
                "available_bytes": self.available_bytes, "budget": self.budget,
                "auto": self.best_fit(), "precisions": [{**asdict(r), "needed_bytes": r.needed_bytes,
                                                         "help": TIER_HELP[r.precision]} for r in self.rows]}

    def table(self) -> list[str]:
        share = f"; per rank: rank {self.rank}'s share of {self.ranks} ranks" if self.ranks > 1 else ""
        lines = [f"{self.model} (stored: {self.stored}); budget {gb(self.available_bytes)} ({self.budget}); "
                 f"KV cache for {self.context_tokens} tokens{share}",
                 f"  {'precision':<10}{'weights':>10}{'KV cache':>10}{'working':>10}{'needed':>10}  fits"]
        # one unit for the whole table ("0.10 GB" above "99 MB" read as a smaller number)
        big = max((r.needed_bytes for r in self.rows), default=0) >= 1e9

        def size(n: int) -> str:
            return f"{n / 1e9:.2f} GB" if big else f"{n / 1e6:.0f} MB"

        for r in self.rows:
            fits = ("yes" if r.loadable and r.fits else "no" if r.loadable
                    else f"-- (its groups do not split over {self.ranks} ranks)" if r.split_refused
                    else "-- (stored form is lossier)")
            lines.append(f"  {r.precision:<10}{size(r.weights_bytes):>10}{size(r.kv_bytes):>10}"
                         f"{size(r.working_bytes):>10}{size(r.needed_bytes):>10}  {fits}")
        best = self.best_fit()
        lines.append(f"  auto loads: {best}" if best else "  auto: nothing fits; see README, Runtime precision (which Mac)")
        return lines


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


# The largest --memory-limit: a byte count any consumer (MLX's size_t, JSON readers) holds
# exactly, far beyond any machine (9.2 EB).
MAX_SIZE = 2**63 - 1


def parse_size(text: str, flag: str = "--memory-limit") -> int:
    """"14GB", "14.5G", "900MB", "16GiB" or a byte count -> bytes (GB = 1e9, GiB = 2**30), at
    least one byte and at most :data:`MAX_SIZE`."""
    m = _SIZE.match(str(text))
    if not m:
        raise ParameterError(f"{flag} {text!r}: expected a size such as 14GB, 14.5G or 900MB")
    unit = (m.group(2) or "b").lower()
    mult = {"b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
            "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20,
            "gi": 2**30, "ti": 2**40}.get(unit)
    # exact decimal arithmetic: 400 digits are a number too large, not a float overflow
    size = Decimal(m.group(1)) * mult if mult is not None else Decimal(0)
    if mult is None or not size > 0:
        raise ParameterError(f"{flag} {text!r}: expected a positive size such as 14GB, 14.5G or 900MB")
    if size < 1:
        raise ParameterError(f"{flag} {text!r}: less than one byte; give a size such as 14GB, 14.5G or 900MB")
    if size > MAX_SIZE:
        raise ParameterError(f"{flag} {text!r}: larger than any machine's memory (at most {MAX_SIZE} bytes); give a "
                             "size such as 14GB, 14.5G or 900MB")
    return int(size)


def rank_inventory(inventory: list[TensorInfo], splits: dict[str, Split]) -> list[TensorInfo]:
    """One rank's share of ``inventory``: every tensor of a module ``splits`` names (the model's
    ``shard_plan``) cut to that rank's slice, in logical units, on the axis the split takes it
    (:func:`mlx_dgemma.distributed.param_slices`); the others whole (replicated)."""
    out = []
    for t in inventory:
        # quantized tensors are named by their module, float ones by their parameter
        split = splits.get(t.module) or splits.get(t.module.rpartition(".")[0])
        if split is None:
            out.append(t)
            continue
        axis, ranges = param_slices(None, split, {"weight": t.shape})["weight"]
        shape = list(t.shape)
        shape[axis] = sum(hi - lo for lo, hi in ranges)
        out.append(TensorInfo(t.module, tuple(shape), t.ggml_type))
    return out


def rank_args(args: ModelArgs, ranks: int, rank: int) -> tuple[ModelArgs, dict[str, Split]]:
    """(the shape one rank computes with, its slices): heads, key/value heads and hidden sizes
    as :meth:`DiffusionGemma.shard` leaves them, for the KV cache and working-memory estimates.
    The vocabulary stays whole: a step draws its Gumbel noise over the whole vocabulary on every
    rank, so the [canvas, vocab] buffers are priced in full (an upper estimate)."""
    from dataclasses import replace

    from .model import DiffusionGemma

    model = DiffusionGemma(args)  # unloaded: MLX arrays are lazy, nothing is allocated
    splits = model.shard_plan(ranks, rank)  # also refuses a split that does not divide the model
    kv = {}
    for layer in model.layers:
        (q_lo, q_hi), (kv_lo, kv_hi) = layer.self_attn.head_splits(ranks, rank)
        kv[layer.self_attn.sliding] = kv_hi - kv_lo
    local = replace(args, num_attention_heads=q_hi - q_lo,
                    num_key_value_heads=kv.get(True, args.num_key_value_heads),
                    num_global_key_value_heads=kv.get(False, args.num_global_key_value_heads),
                    intermediate_size=args.intermediate_size // ranks,
                    moe_intermediate_size=args.moe_intermediate_size // ranks)
    return local, splits


def cuts_groups(inventory: list[TensorInfo], splits: dict[str, Split], form: str, num_layers: int) -> bool:
    """Whether ``splits`` would cut a quantization group of a tensor re-quantized to ``form``
    (``mlx_dgemma.tiers.target``) *before* the split: a .gguf's q4/q3 is made whole, and a q4/q3
    directory is stored so (the published experts' 704-wide rows in groups of 64 do not halve).
    The same rule as the load's (:func:`mlx_dgemma.distributed.param_slices`)."""
    from types import SimpleNamespace

    from .tiers import target

    for t in inventory:
        split = splits.get(t.module)
        goal = target(form, t.module, t.ggml_type, num_layers, t.shape[-1]) if split is not None else None
        if goal is None:
            continue
        try:
            param_slices(SimpleNamespace(group_size=goal.group_size, bits=goal.bits), split,
                         {"weight": t.shape, "scales": ()})
        except ParameterError:
            return True
    return False


def make_plan(model: str, args: ModelArgs, inventory: list[TensorInfo], stored: str, *,
              context_tokens: int = DEFAULT_CONTEXT, memory_limit: int | None = None,
              gpu: bool | None = None, ranks: int = 1, rank: int = 0) -> Plan:
    """Price every precision for a model described by ``args`` and its tensor ``inventory``
    (``stored``: "gguf", or a directory's precision), against ``memory_limit`` or the device.
    ``ranks > 1``: rank ``rank``'s share of the model split over ``ranks`` (see the module)."""
    import mlx.core as mx

    gpu = (mx.default_device() == mx.gpu) if gpu is None else gpu
    act = 2 if gpu else 4  # the lossy precisions' activation dtype: bfloat16 on a GPU, float32 on the CPU
    if memory_limit is not None:
        available, budget = memory_limit, "--memory-limit"
    else:
        available, budget = device_budget()
    layers = args.num_hidden_layers
    full, shape, splits = inventory, args, {}
    if ranks > 1:
        shape, splits = rank_args(args, ranks, rank)
        inventory = rank_inventory(inventory, splits)
    from_form = "exact" if stored == "gguf" else stored

    def priced(inv: list[TensorInfo], p: str) -> int:
        return (weight_bytes(inv, "exact", layers) if p == "exact"
                else weight_bytes(inv, p, layers, scale_bytes=act, float_bytes=act))

    rows = []
    for p in TIERS:
        w, itemsize = priced(inventory, p), 4 if p == "exact" else act
        est = estimate(shape, context_tokens, new_blocks=0, dtype=mx.float32 if itemsize == 4 else mx.bfloat16)
        loadable = TIERS.index(p) >= TIERS.index(from_form)
        # several ranks: a form quantized before the split must split at whole groups (a
        # directory's stored form; a .gguf's q4/q3, made whole). Re-quantized after it, it is.
        before = from_form if stored != "gguf" else p if p in ("q4", "q3") else None
        refused = ranks > 1 and loadable and before is not None and cuts_groups(full, splits, before, layers)
        loadable = loadable and not refused
        if stored == "gguf":
            # converted whole in memory (every rank converts all of it, then keeps its slices)
            peak = priced(full, p)
        else:  # a tier made at load time from a directory holds that directory's form first
            peak = w if p == from_form else max(w, weight_bytes(inventory, from_form, layers))
        need = max(w + est.kv_bytes + est.working_bytes, peak)
        rows.append(PlanRow(p, w, est.kv_bytes, est.working_bytes, peak, loadable, need <= available, refused))
    return Plan(model, stored, context_tokens, available, budget, tuple(rows), ranks, rank)


def choose_across_ranks(plan: Plan, requested: str) -> str:
    """:meth:`Plan.choose` on every rank of a launched group (``mlx.launch``), agreed: ``auto``
    becomes the most exact form that every rank holds (each rank's own choice, then the least
    exact of them: one all-reduce of its index), so the ranks load the same precision. If the
    precision fits nowhere on some rank, every rank raises (``rank N: ...`` with that rank's
    figures, :func:`mlx_dgemma.distributed.agree`). In one process: ``plan.choose(requested)``.

    Every rank must call it at the same point (the loader does, before reading weights)."""
    from .distributed import agree_max, world

    if world() is None:
        return plan.choose(requested)
    order = AUTO_ORDER if requested == "auto" else (requested,)
    try:
        mine, error = order.index(plan.choose(requested)), None
    except DGemmaError as e:  # its memory, or a split its stored groups refuse
        mine, error = 0, e
    return order[agree_max(mine, error)]
