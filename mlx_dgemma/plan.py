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
weight is read, with one line naming what would fit and the command that makes it: a lossier
precision, or a form to convert the GGUF to (a tier made at load from an exact directory holds
the exact form first, so a small Mac needs the tier converted). On a Mac, when no form fits the
default GPU limit but one would below :func:`mlx_dgemma.machines.max_wired_limit_bytes`, it
also gives the ``sysctl`` that raises the limit, and its risk.

The budget is one of: ``--memory-limit`` (the one budget: the plan's and every prompt's, see
:mod:`mlx_dgemma.memory`), a Mac preset (``--machine``, :mod:`mlx_dgemma.machines`), or this
device's (:func:`mlx_dgemma.memory.device_budget`). The pricing imports no MLX unless it asks
the device (the converter plans too, where MLX is not imported).

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
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DGemmaError, MemoryBudgetError, ParameterError
from .machines import MACHINES, GiB, Machine, MiB
from .memory import device_budget, estimate, gb
from .schema import ModelArgs
from .tiers import AUTO_ORDER, TIERS, TensorInfo, tier, weight_bytes

if TYPE_CHECKING:
    from .distributed import Split

DEFAULT_CONTEXT = 4096  # tokens the plan reserves KV cache for (prompt, history and answer)


@dataclass(frozen=True)
class Budget:
    """What a plan compares with: ``bytes``, where they come from (``label``), the Mac they
    describe (a preset or this Mac: its RAM bounds the GPU-limit hint; None elsewhere), and
    whether the lossy precisions run on a GPU (bfloat16 activations) or MLX's CPU (float32)."""

    bytes: int
    label: str
    machine: Machine | None = None
    gpu: bool = True


def machine_budget(m: Machine) -> Budget:
    """A Mac's default budget: Metal's working set (a Mac runs on its GPU)."""
    return Budget(m.working_set_bytes, m.label, m, True)


def offline_budget(memory_limit: int | None = None, machine: Machine | None = None) -> Budget:
    """The budget without MLX (the converter's: it never imports MLX): ``memory_limit``, else
    the preset ``machine``, else this machine: on a Mac its default working set (read from
    ``sysctl``: :func:`mlx_dgemma.machines.this_mac`), elsewhere available RAM."""
    from .machines import this_mac
    from .memory import system_available_bytes

    if memory_limit is not None:
        return Budget(memory_limit, "--memory-limit", None, sys.platform == "darwin")
    machine = machine or this_mac()
    if machine is not None:
        return machine_budget(machine)
    avail = system_available_bytes()
    return Budget(avail if avail is not None else 1 << 62, "this machine's available RAM", None, False)


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
    # fast on a GPU: its 5-bit legacy weights repacked to 8 bits (lossless, mlx_dgemma.tiers.REPACK_TYPES):
    # True when counted in and done, False when it would not fit and the weights stay 5-bit
    # (the figures are those of the 5-bit form), None when there is nothing to repack
    repacked: bool | None = None
    repack_bytes: int = 0  # what the repack adds (or would add) to the weights

    @property
    def resident_bytes(self) -> int:
        """Once loaded: the weights, the KV cache and a step's working memory. What a directory
        converted to this precision needs (it loads without holding another form first)."""
        return self.weights_bytes + self.kv_bytes + self.working_bytes

    @property
    def needed_bytes(self) -> int:
        return max(self.resident_bytes, self.load_peak_bytes)


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
    machine: Machine | None = None  # the Mac the budget describes (a preset or this Mac), else None
    gguf: str | None = None  # the .gguf to convert from (the model itself, or the one its directory names)
    # A load's plan (loader.plan_load) carries the model it priced, opened and checked once
    # (loader.ModelSource: a .gguf's GGUFSource, or a directory's checked config), which the load
    # then reads, and the precision chosen for it (under mlx.launch agreed by every rank): the
    # load neither opens the file nor plans again. None on a plan that only prices (`plan`).
    source: Any = field(default=None, compare=False, repr=False)
    chosen: str | None = None
    # an exact directory that holds fast's re-quantized tensors (mlx_dgemma.sidecar): fast loads
    # from it without re-quantizing, so no advice to convert fast
    fast_stored: bool = False

    def row(self, precision: str) -> PlanRow:
        return next(r for r in self.rows if r.precision == precision)

    def best_fit(self, candidates: tuple[str, ...] = AUTO_ORDER) -> str | None:
        """The most exact of ``candidates`` that is loadable and fits, or None."""
        return next((r.precision for r in self.rows if r.precision in candidates and r.loadable and r.fits), None)

    def best_form(self, candidates: tuple[str, ...] = AUTO_ORDER) -> str | None:
        """The most exact of ``candidates`` that fits once converted to it (its resident bytes:
        no other form held while loading), or None: what ``convert --precision auto`` writes."""
        return next((r.precision for r in self.rows if r.precision in candidates
                     and r.resident_bytes <= self.available_bytes), None)

    def choose(self, requested: str) -> str:
        """The precision to load: ``requested``, or for ``auto`` the most exact that fits.
        Raises :class:`MemoryBudgetError` (one line) when it does not fit."""
        if requested == "auto":
            choice = self.best_fit(self.auto_candidates)
            if choice is None:
                stored = self.auto_candidates[0]
                if self.row(stored).split_refused:
                    raise ParameterError(self.split_refusal(stored))
                raise MemoryBudgetError(self.refusal("auto"))
            return choice
        row = self.row(requested)
        if row.split_refused:
            raise ParameterError(self.split_refusal(requested))
        if row.loadable and not row.fits:
            raise MemoryBudgetError(self.refusal(requested))
        return requested

    @property
    def auto_candidates(self) -> tuple[str, ...]:
        """What ``auto`` tries: ``AUTO_ORDER`` from the stored form on (a directory's form is
        never made more exact)."""
        stored = self.stored if self.stored in AUTO_ORDER else AUTO_ORDER[0]
        return AUTO_ORDER[AUTO_ORDER.index(stored):]

    @property
    def is_demo(self) -> bool:
        """The model is the built-in demo (the package's GGUF): its forms take milliseconds to
        make, and a directory of them must not be named like the real model's."""
        from .demo import trained_demo_path

        return self.gguf is not None and Path(self.gguf).resolve() == trained_demo_path().resolve()

    def convert_command(self, precision: str) -> str:
        """The command that writes ``precision``'s form: from this .gguf, or the one this
        directory was converted from (config.json names it), to a directory beside it."""
        src = self.gguf or "FILE.gguf"
        if self.stored != "gguf":
            return f"mlx-dgemma convert {src} {self.model.rstrip('/')}-{precision} --precision {precision}"
        name = "dgemma-demo" if self.is_demo else "dgemma"  # README's directory for the real model
        if tier(precision).lossless:  # convert's default
            return f"mlx-dgemma convert {src} ~/models/{name}"
        return f"mlx-dgemma convert {src} ~/models/{name}-{precision} --precision {precision}"

    def wired_hint(self, precision: str) -> str | None:
        """On a Mac, the ``sysctl`` that raises the GPU's limit so ``precision`` fits (converted
        once to its form, unless this is that form: a .gguf or another form re-quantizes at every
        start, and a tier made from an exact directory holds the exact form first), with its
        risk; None when the Mac's safe ceiling (:func:`mlx_dgemma.machines.max_wired_limit_bytes`)
        would not do."""
        m = self.machine
        if m is None:
            return None
        r = self.row(precision)
        stored_so = r.loadable and self.stored == precision  # loads as stored: nothing else held first
        mb = math.ceil((r.resident_bytes + GiB) / MiB)  # 1 GiB over the plan's figure: the process's own memory
        if mb * MiB > m.max_wired_limit_bytes:
            return None
        left = (m.ram_bytes - mb * MiB) / 1e9
        how = (f"raise the GPU's limit to run {precision}" if stored_so else
               f"convert to {precision} once (`{self.convert_command(precision)}`) and raise the GPU's limit")
        return (f"{how}: `sudo sysctl iogpu.wired_limit_mb={mb}` (until reboot; it leaves {left:.1f} GB to macOS "
                "and every other app: quit the others, or the Mac can stall or freeze)")

    def advice(self, precision: str) -> list[str]:
        """What to do when ``precision`` (or ``auto``) does not fit, most direct first: a
        lossier precision that fits (and the command that makes its form, so it loads without
        re-quantizing at every start), else the form to convert to, else that nothing fits;
        on a Mac where nothing fits the default limit, the GPU-limit hint."""
        lossier = (self.auto_candidates if precision == "auto"
                   else tuple(p for p in TIERS if TIERS.index(p) > TIERS.index(precision)))
        forms = lossier if precision == "auto" else (precision, *lossier)
        out = []
        fit = self.best_fit(lossier)
        form = self.best_form(forms)
        if fit is not None:
            line = f"--precision {fit} fits ({gb(self.row(fit).needed_bytes)})"
            if fit != self.stored and not self.is_demo:  # made at every start: once, on disk, it loads in seconds
                line += f"; to load it without re-quantizing at every start: `{self.convert_command(fit)}`"
            out.append(line)
        elif form is not None:
            why = ("" if self.stored == "gguf" else
                   f" (a precision made at load from this directory holds its {self.stored} form first)")
            out.append(f"no precision fits when made from this {'file' if self.stored == 'gguf' else 'directory'}"
                       f"{why}; converted to {form} it fits ({gb(self.row(form).resident_bytes)}): "
                       f"`{self.convert_command(form)}`")
        else:
            small = self.row(TIERS[-1])
            out.append(f"no form of this model fits ({TIERS[-1]}, the smallest, needs {gb(small.resident_bytes)})")
            hint = next((h for h in map(self.wired_hint, forms) if h is not None), None)
            if hint is not None:
                out.append(f"or {hint}")
        return out

    def refusal(self, precision: str) -> str:
        """One line: what ``precision`` needs (for ``auto``: its first candidate) against what is
        available, then :meth:`advice`."""
        shown = self.auto_candidates[0] if precision == "auto" else precision
        r = self.row(shown)
        where = f" on rank {self.rank} of {self.ranks} (its share)" if self.ranks > 1 else ""
        line = (f"{self.model}: --precision {shown} needs about {gb(r.needed_bytes)}{where} (weights "
                f"{gb(r.weights_bytes)}, KV cache {gb(r.kv_bytes)} for {self.context_tokens} tokens, working "
                f"{gb(r.working_bytes)}) but {gb(self.available_bytes)} is available ({self.budget}); ")
        return line + "; ".join(self.advice(precision))

    def split_refusal(self, precision: str) -> str:
        """One line: ``precision`` is quantized before the split, in groups the split would cut."""
        where = "stored so in this directory" if self.stored != "gguf" else "made whole from the .gguf"
        return (f"{self.model}: --precision {precision} is {where}, in quantization groups that do not split "
                f"over {self.ranks} ranks; give the ranks a directory converted with --precision exact or fast "
                f"(each rank re-quantizes its own slices to {precision})")

    def repack_note(self) -> str | None:
        """One line when fast's 8-bit repack of its 5-bit weights does not fit (fast loads
        them 5-bit, slower on a GPU), else None."""
        r = self.repack_row
        if r is None or r.repacked is not False:
            return None
        return (f"{self.model}: {r.precision} keeps its 5-bit (Q5_0/Q5_1) weights 5-bit: repacked to 8 bits "
                f"(lossless, faster on a GPU) they would take {gb(r.repack_bytes)} more, and the repack is made only "
                f"where as much again stays free of the {gb(self.available_bytes)} available ({self.budget})")

    @property
    def repack_row(self) -> PlanRow | None:
        """The row of the precision that repacks its 5-bit weights on a GPU (fast), if any."""
        return next((r for r in self.rows if tier(r.precision).repack), None)

    def to_dict(self) -> dict[str, Any]:
        best = self.best_fit(self.auto_candidates)
        return {"model": self.model, "stored": self.stored, "ranks": self.ranks, "rank": self.rank,
                "context_tokens": self.context_tokens,
                "available_bytes": self.available_bytes, "budget": self.budget,
                "machine": None if self.machine is None else asdict(self.machine),
                "auto": best, "best_form": self.best_form(),
                "advice": self.advice("auto") if best is None or best != self.stored else [],
                "precisions": [{**asdict(r), "needed_bytes": r.needed_bytes, "resident_bytes": r.resident_bytes,
                                "help": tier(r.precision).help} for r in self.rows]}

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
        best = self.best_fit(self.auto_candidates)
        if best is None:  # one line, the table's last (before the notes): scripts read it
            lines.append("  auto: nothing fits; " + "; ".join(self.advice("auto")))
        else:
            lines.append(f"  auto loads: {best}")
            made = best != self.stored and not (best == "fast" and self.fast_stored)
            form = self.best_form(TIERS) if self.stored == "gguf" else best
            if made and form is not None and not self.is_demo:  # made at every start (the demo's: milliseconds)
                # a .gguf: the form `convert --precision auto` writes (exact where it runs: its
                # directory loads fast from its sidecar); a directory: the form auto loads
                lines.append(f"  to convert once instead of at every start: `{self.convert_command(form)}`"
                             + (" (the form `--precision auto` writes)" if self.stored == "gguf" else ""))
        repack = self.repack_row
        if repack is not None and not repack.loadable:  # a lossier stored form: that row is not an option
            repack = None
        if repack is not None and repack.repacked and repack.fits:
            lines.append(f"  {repack.precision}'s figures include its 5-bit (Q5_0/Q5_1) weights repacked to 8 bits "
                         f"on the GPU (+{gb(repack.repack_bytes)}, lossless: the same values, faster kernels)")
        elif repack is not None and repack.repacked is False and repack.fits:
            lines.append(f"  {self.repack_note()}")
        if self.machine is not None and self.machine.nax:
            lines.append("  an M5-class GPU: under macOS 26.2 or later MLX runs float32 matmuls with TF32-like (NAX) "
                         "kernels unless MLX_ENABLE_TF32=0, so exact is bit-exact only with it set")
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
    from .distributed import param_slices

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

    from .distributed import param_slices
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
              gpu: bool | None = None, ranks: int = 1, rank: int = 0, machine: Machine | str | None = None,
              budget: Budget | None = None, gguf: str | None = None, fast_stored: bool = False) -> Plan:
    """Price every precision for a model described by ``args`` and its tensor ``inventory``
    (``stored``: "gguf", or a directory's precision), against ``budget``, else ``memory_limit``,
    else the Mac preset ``machine``, else this device (``gpu``: where the lossy precisions run;
    default the device's). ``gguf``: the file a directory was converted from (for the advice);
    ``fast_stored``: an exact directory holding fast's sidecar (fast then needs no conversion).
    ``ranks > 1``: rank ``rank``'s share of the model split over ``ranks`` (see the module)."""
    if isinstance(machine, str):
        from .machines import machine as preset

        machine = preset(machine)
    if budget is None and memory_limit is not None:
        budget = Budget(memory_limit, "--memory-limit", None, _on_gpu() if gpu is None else gpu)
    elif budget is None and machine is not None:
        budget = machine_budget(machine)
    elif budget is None:
        available, label = device_budget()
        mac = None
        if sys.platform == "darwin" and label.startswith("Metal"):  # this Mac: its RAM bounds the GPU-limit hint
            from .memory import device_ram_bytes

            ram = device_ram_bytes()
            mac = Machine("this Mac", ram, available) if ram else None
        budget = Budget(available, label, mac, _on_gpu() if gpu is None else gpu)
    if gpu is not None and gpu != budget.gpu:
        budget = Budget(budget.bytes, budget.label, budget.machine, gpu)
    available = budget.bytes
    act = 2 if budget.gpu else 4  # the lossy precisions' activation dtype: bfloat16 on a GPU, float32 on the CPU
    layers = args.num_hidden_layers
    full, shape, splits = inventory, args, {}
    if ranks > 1:
        shape, splits = rank_args(args, ranks, rank)
        inventory = rank_inventory(inventory, splits)
    from_form = "exact" if stored == "gguf" else stored

    def priced(inv: list[TensorInfo], p: str, repack: bool = False) -> int:
        return (weight_bytes(inv, p, layers) if tier(p).lossless
                else weight_bytes(inv, p, layers, scale_bytes=act, float_bytes=act, repack=repack))

    rows = []
    for p in TIERS:
        row = tier(p)
        w, itemsize = priced(inventory, p), 4 if row.lossless else act
        # fast on a GPU repacks its 5-bit weights to 8 bits (what that adds: ``extra``) where that
        # fits with as much again to spare, else loads them as stored: the repack never makes fast not fit
        extra = priced(inventory, p, repack=True) - w if budget.gpu and row.repack else 0
        est = estimate(shape, context_tokens, new_blocks=0, dtype=itemsize)
        loadable = TIERS.index(p) >= TIERS.index(from_form)
        # several ranks: a form quantized before the split must split at whole groups (a
        # directory's stored form; a .gguf's q4/q3, made whole). Re-quantized after it, it is.
        before = from_form if stored != "gguf" else p if row.requantizes else None
        refused = ranks > 1 and loadable and before is not None and cuts_groups(full, splits, before, layers)
        loadable = loadable and not refused
        for repack in (True, False) if extra else (False,):
            held = w + extra if repack else w
            if stored == "gguf":
                # converted whole in memory (every rank converts all of it, then keeps its slices)
                peak = priced(full, p, repack)
            elif p == from_form and not repack:
                peak = held
            else:  # made at load time from a directory, which holds that directory's form first
                peak = max(held, weight_bytes(inventory, from_form, layers))
            # the repack is a speed-up, not a need: it is made only where it leaves at least its own
            # size free, so it never takes most of the room a longer conversation would use
            margin = extra if repack else 0
            fits = max(held + est.kv_bytes + est.working_bytes + margin, peak) <= available
            if fits or not repack:
                break
        rows.append(PlanRow(p, held, est.kv_bytes, est.working_bytes, peak, loadable, fits, refused,
                            repack if extra else None, extra))
    return Plan(model, stored, context_tokens, available, budget.label, tuple(rows), ranks, rank,
                budget.machine, gguf if gguf is not None else model if stored == "gguf" else None,
                fast_stored=fast_stored)


def machine_table(model: str, args: ModelArgs, inventory: list[TensorInfo], stored: str,
                  context_tokens: int | None = None, gguf: str | None = None) -> list[dict[str, Any]]:
    """``plan --machine all``: for every Mac preset, what Metal offers by default, the forms of
    this model that fit once converted, what ``auto`` loads from it as stored, and the one
    command to run (convert to the most exact form that fits, as ``convert --precision auto``
    does; where none fits the default limit, the form and the GPU limit that would do)."""
    out = []
    for m in MACHINES.values():
        plan = make_plan(model, args, inventory, stored, context_tokens=context_tokens or DEFAULT_CONTEXT,
                         machine=m, gguf=gguf)
        form = plan.best_form(TIERS)  # what `convert --precision auto` writes for this Mac
        hint = None if form is not None else next(
            (h for h in map(plan.wired_hint, AUTO_ORDER) if h is not None), None)
        out.append({"machine": m.name, "stored": stored, "ram_gb": m.ram_gb, "working_set_bytes": m.working_set_bytes,
                    "measured": m.measured, "nax": m.nax,
                    "forms": [r.precision for r in plan.rows if r.resident_bytes <= plan.available_bytes],
                    "auto": plan.best_fit(plan.auto_candidates),
                    "smallest_bytes": plan.row(TIERS[-1]).resident_bytes,
                    "command": plan.convert_command(form) if form is not None else None, "wired_hint": hint})
    return out


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`machine_table` as README prints it (tests/test_machines.py keeps README in step)."""
    source = "the .gguf" if rows and rows[0]["stored"] == "gguf" else "this directory"
    lines = [f"| Mac | GPU working set (Metal's default) | forms that fit | `auto` from {source} | what to run |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        ws = f"{r['working_set_bytes'] / 1e9:.2f} GB" + ("" if not r["measured"] else " (logged on a Mac)")
        forms = ", ".join(r["forms"]) or f"none ({TIERS[-1]}, the smallest, needs {r['smallest_bytes'] / 1e9:.2f} GB)"
        if r["command"] is not None:
            run = f"`{r['command']}`"
        elif r["wired_hint"] is not None:
            run = r["wired_hint"][0].upper() + r["wired_hint"][1:]
        else:
            run = "nothing runs it: use a Mac with more memory"
        name = r["machine"] + (" (M5: NAX)" if r["nax"] else "")
        lines.append(f"| {name} | {ws} | {forms} | {r['auto'] or 'refused (exit 1)'} | {run} |")
    return lines


def _on_gpu() -> bool:
    """Whether MLX's default device is a GPU (imports MLX)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu


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
