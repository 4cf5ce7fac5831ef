"""``load(path)``, the one entry point from a path to a :class:`~mlx_dgemma.runtime.Runtime`
(model, tokenizer, generation defaults, precision): a converted MLX directory, or a .gguf
converted in memory."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .distributed import load_sharded_weights, world
from .errors import ModelFilesError, ParameterError
from .gpu import memory_errors
from .model import DiffusionGemma, ModelArgs
from .paths import check_model_choice, check_model_path, resolve_model, user_path  # noqa: F401 (re-exported)
from .precision import Precision, apply_precision, check_loadable, resolve_precision, stored_precision
from .quantized import quantize_modules
from .runtime import Runtime
from .schema import QuantSpec
from .tokenizer import Tokenizer
from .validate import check_model_dir, model_dir_shards

if TYPE_CHECKING:
    from .plan import Plan
    from .tiers import TensorInfo

log = logging.getLogger("mlx_dgemma.loader")


def build_model(config: dict[str, Any]) -> DiffusionGemma:
    """An (unloaded) model whose modules match the config's quantization section."""
    model = DiffusionGemma(ModelArgs.from_config(config))
    quantize_modules(model, config.get("quantization", {}))
    return model


def _load_weights(model: nn.Module, weights: list[tuple[str, mx.array]], source: str) -> None:
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise ModelFilesError(f"{source}: weights do not match config.json ({e}); convert the model again") from e


def _layer_index(name: str) -> int | None:
    """The decoder layer a weight's name belongs to (``layers.3.…``), or None (embedding, norm, head)."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def truncated_config(config: dict, layers: int) -> dict:
    """config.json for the first ``layers`` layers (at most the model's; quantization entries of
    later layers dropped)."""
    cfg = json.loads(json.dumps(config))
    tc = cfg["text_config"]
    layers = min(layers, int(tc["num_hidden_layers"]))
    tc["num_hidden_layers"] = layers
    tc["layer_types"] = list(tc["layer_types"])[:layers]
    q = cfg.get("quantization", {})
    cfg["quantization"] = {k: v for k, v in q.items()
                           if not isinstance(v, dict) or _layer_index(k) is None or _layer_index(k) < layers}
    return cfg


def _first_layers(weights: list[tuple[str, mx.array]], layers: int | None) -> list[tuple[str, mx.array]]:
    """``weights`` without those of the layers from ``layers`` on (all of them for None)."""
    if layers is None:
        return weights
    return [(k, a) for k, a in weights if (i := _layer_index(k)) is None or i < layers]


def load_dir(path: Path, precision: Precision | str = "exact",
             layers: int | None = None, config: dict | None = None) -> tuple[DiffusionGemma, dict]:
    """A converted directory, loaded as stored and then put in ``precision``'s runtime form
    (the stored form or a less exact one). ``layers``: only the first that many layers
    (:func:`load_layers`; only their weights are read). ``config``: its config.json as
    :func:`~mlx_dgemma.validate.check_model_dir` returned it (the plan's :class:`ModelSource`
    checked it), else it is checked here."""
    if config is None:
        config = check_model_dir(path)  # every file's keys, types, ranges and headers, before any work
    prec = resolve_precision(precision)
    if layers is None:
        check_loadable(stored_precision(config), prec, str(path))
    else:
        # doctor checks the device's arithmetic on the weights as stored: a directory converted to
        # q4 runs its q4 weights under whatever precision doctor names (check_loadable would refuse
        # exact, and advise a --precision that doctor does not take)
        config = truncated_config(config, layers)
    shards = model_dir_shards(path)
    try:
        model = build_model(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFilesError(f"{path / 'config.json'}: does not describe a buildable model ({e}); convert "
                              "the model again") from e
    weights: list[tuple[str, mx.array]] = []
    group = world()  # several ranks (mlx.launch): shard, and read only this rank's slices of the files
    if group is not None:
        weights = load_sharded_weights(model, shards, group)
    else:
        for f in shards:
            weights.extend(mx.load(str(f)).items())  # lazy: a weight left out below is never read
    _load_weights(model, _first_layers(weights, layers), str(path))
    weights.clear()
    mx.eval(model.parameters())
    # fast's sidecar holds whole tensors: a rank's slices re-quantize as before
    apply_precision(model, prec, config.get("quantization"), model_dir=path if group is None else None,
                    config=config)
    return model, config


def load_gguf(path: Path, precision: Precision | str = "exact",
              progress: Callable[[int, int, str], None] | None = None,
              layers: int | None = None, source: Any = None) -> tuple[DiffusionGemma, dict, dict]:
    """Convert a GGUF in memory (same repack as ``convert``); returns model, config and the side
    data (``generation_config``, ``tokenizer``, and ``chat_template`` when the GGUF has one).
    ``layers``: only the first that many layers are kept (:func:`load_layers`; all are converted).
    ``source``: the file's :class:`~mlx_dgemma.convert.GGUFSource`, already opened (the plan's),
    else it is opened here; either way it is closed once read.

    A memory tier (q4, q3) is re-quantized tensor by tensor as it is read, so the exact form is
    never held; exact and fast are repacked exactly, then put in their runtime form.
    """
    from mlx_dgemma.convert import BF16Payload, GGUFSource

    prec = resolve_precision(precision)
    form = prec.name if prec.lossy_weights else "exact"

    def report(done: int, total: int, i: int, n: int, name: str) -> None:
        progress(i, n, name)

    weights: list[tuple[str, mx.array]] = []
    specs: dict[str, QuantSpec] = {}
    with source if source is not None else GGUFSource(path) as source:
        for c in source.tensors(form, progress=report if progress else None):
            for name, a in c.arrays.items():
                arr = mx.array(a.view(np.uint16)).view(mx.bfloat16) if isinstance(a, BF16Payload) else mx.array(a)
                weights.append((name, arr))
            if c.spec is not None:
                specs[c.module] = c.spec
        config = source.config(specs, form)
        if layers is not None:
            config = truncated_config(config, layers)
        model = build_model(config)
        _load_weights(model, _first_layers(weights, layers), str(path))
        weights.clear()
        if (group := world()) is not None:  # several ranks: each converted the whole GGUF, keeps its slices
            model.shard(group)
        mx.eval(model.parameters())
        apply_precision(model, prec, config["quantization"])
        mx.clear_cache()  # the conversion's temporaries: see apply_precision
        side = {"generation_config": source.generation_config, "tokenizer": source.tokenizer}
        if source.chat_template is not None:
            side["chat_template"] = source.chat_template
    return model, config, side


@dataclass
class ModelSource:
    """A model opened and checked once, for its memory plan and then its load: a .gguf's
    :class:`~mlx_dgemma.convert.GGUFSource` (the file scanned, its metadata and tensor table
    validated; its handle held until the load has read it) or a converted directory's
    config.json (checked with every shard's header); with what the plan prices: the shape,
    the tensor inventory (from the header or config alone: no weight is read) and the stored
    form ("gguf", or the directory's precision). Close it (or use it as a context manager)
    when no load will read it."""

    path: Path
    args: ModelArgs
    inventory: list[TensorInfo]
    stored: str
    gguf: Any = None  # the GGUFSource of a .gguf
    config: dict | None = None  # a directory's checked config.json
    read: bool = False  # a load has read it (and closed the file): a plan loads once

    @classmethod
    def open(cls, path: str | Path) -> "ModelSource":
        """Open and check the converted directory or .gguf at ``path``."""
        from .tiers import TensorInfo, stored_precision

        p = user_path(path)
        if p.is_dir():
            config = check_model_dir(p)
            args = ModelArgs.from_config(config)
            specs = {k: QuantSpec.from_dict(v) for k, v in config.get("quantization", {}).items()
                     if isinstance(v, dict)}
            # the unloaded model's parameter shapes: MLX arrays are lazy, nothing is allocated
            from mlx.utils import tree_flatten

            inventory = []
            for name, a in tree_flatten(DiffusionGemma(args).parameters()):
                module = name[:-len(".weight")] if name.endswith(".weight") else name
                spec = specs.get(module)
                inventory.append(TensorInfo(module, tuple(a.shape), spec.ggml_type or "Q8_0") if spec is not None
                                 else TensorInfo(name, tuple(a.shape), "F32"))
            return cls(p, args, inventory, stored_precision(config), config=config)
        if p.is_file():
            from mlx_dgemma.convert import GGUFSource

            source = GGUFSource(p)
            return cls(p, source.args, [TensorInfo(*t) for t in source.inventory()], "gguf", gguf=source)
        raise ModelFilesError(f"{p}: no such file or directory; give a .gguf file or a directory written by "
                              "`mlx-dgemma convert`")

    def close(self) -> None:
        """Close a .gguf's file and let its memory map go (a plan kept after its load holds no file)."""
        if self.gguf is not None:
            self.gguf.close()
            self.gguf = None

    def __enter__(self) -> "ModelSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def model_inventory(path: str | Path) -> tuple[ModelArgs, list, str]:
    """(shape, tensor inventory, stored form) of a converted directory or a .gguf, from its
    config or header alone (no weight is read): what the memory plan prices."""
    with ModelSource.open(path) as source:
        return source.args, source.inventory, source.stored


def plan_model(path: str | Path | ModelSource, memory_limit: int | None = None, context_tokens: int | None = None,
               ranks: int | None = None, rank: int | None = None, machine: str | None = None) -> Plan:
    """The memory plan (:class:`mlx_dgemma.plan.Plan`) of a model, before loading it: of the
    whole model, or of rank ``rank``'s share over ``ranks`` (default: this process's launched
    group, ``mlx.launch``; one process has no share); against ``memory_limit`` bytes, else the
    Mac preset ``machine`` (:mod:`mlx_dgemma.machines`), else this device. ``path``: the model's
    path (opened, priced, closed), or an opened :class:`ModelSource`, which the plan then
    carries (``plan.source``, for the load)."""
    from .plan import DEFAULT_CONTEXT, make_plan

    group = world() if ranks is None else None
    ranks = (group.size() if group is not None else 1) if ranks is None else ranks
    rank = (group.rank() if group is not None else 0) if rank is None else rank
    source = path if isinstance(path, ModelSource) else None
    if source is not None:
        path, args, inventory, stored = source.path, source.args, source.inventory, source.stored
    else:
        args, inventory, stored = model_inventory(path)
    plan = make_plan(str(path), args, inventory, stored, context_tokens=context_tokens or DEFAULT_CONTEXT,
                     memory_limit=memory_limit, ranks=ranks, rank=rank, machine=machine,
                     gguf=None if stored == "gguf" else converted_from(path),
                     fast_stored=stored == "exact" and fast_sidecar_recorded(path))
    return plan if source is None else replace(plan, source=source)


def plan_load(path: str | Path, precision: str = "auto", memory_limit: int | None = None) -> Plan:
    """The plan of one load, made once: the model at ``path`` opened and checked
    (:class:`ModelSource`, carried as ``plan.source``), priced (under ``mlx.launch`` this rank's
    share) and the precision chosen (``plan.chosen``: ``precision``, or for ``auto`` the most
    exact form that fits; under ``mlx.launch`` agreed by every rank,
    :func:`mlx_dgemma.plan.choose_across_ranks`). Raises the plan's one-line refusal when
    ``precision`` does not fit. :func:`load` (``plan=``) reads that source and takes that choice."""
    from .plan import choose_across_ranks

    source = ModelSource.open(path)
    try:
        plan = plan_model(source, memory_limit)
        return replace(plan, chosen=choose_across_ranks(plan, precision))
    except BaseException:
        source.close()
        raise


def _dir_config(path: str | Path) -> dict:
    """A converted directory's config.json for the plan's advice ({} where there is none to read:
    the load itself checks it)."""
    try:
        config = json.loads((user_path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def converted_from(path: str | Path) -> str | None:
    """The .gguf a converted directory was made from, as its config.json names it, or None."""
    section = _dir_config(path).get("mlx_dgemma")
    source = section.get("source") if isinstance(section, dict) else None
    return source if isinstance(source, str) and source.endswith(".gguf") else None


def fast_sidecar_recorded(path: str | Path) -> bool:
    """A converted directory records fast's sidecar (:func:`mlx_dgemma.sidecar.recorded`)."""
    from .sidecar import recorded

    return recorded(user_path(path), _dir_config(path))


@memory_errors("loading the model")  # a GPU out of memory: the one-line budget error
def load(path: str | Path, precision: str | Precision = "auto", dtype: str | mx.Dtype | None = None,
         progress: Callable[[int, int, str], None] | None = None,
         memory_limit: int | None = None, plan: Plan | None = None) -> Runtime:
    """Load a converted directory, or convert a .gguf in memory: a :class:`Runtime` (``.model``,
    ``.tokenizer``, ``.generation_config``, ``.precision``) for ``generate``/``stream_generate``.

    ``precision`` is the runtime precision (``mlx_dgemma.precision``): "exact" (float32,
    bit-exact weights), "fast" (the device's fast activation dtype, scales cast to it, padded
    sub-block tensors re-quantized to 8 bits), the memory tiers "q4" and "q3" (weights
    re-quantized, ``mlx_dgemma.tiers``) or "auto" (= fast). ``dtype`` picks the lossy
    precisions' activation dtype (default: bfloat16 on a GPU, float32 on the CPU). Nothing on
    disk changes.
    ``~`` and environment variables in ``path`` are expanded.

    Before any weight is read, a memory plan (:mod:`mlx_dgemma.plan`) prices the precision
    against the device (or ``memory_limit`` bytes): ``auto`` becomes the most exact form that
    fits, and a precision that does not fit raises :class:`MemoryBudgetError` (one line).
    The runtime carries the model's generation defaults (generation_config.json or the
    GGUF's) and the resolved precision.

    ``plan``: that plan, made already (:func:`plan_load` of this path and precision: a front
    end plans before it starts, to refuse early); the load then reads the model it opened and
    takes its choice, neither opening the file nor planning again. A plan loads once.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ParameterError(f"load(): path: expected a .gguf file or a directory written by `mlx-dgemma convert`, "
                             f"got {repr(path) if isinstance(path, str) else type(path).__name__}", param="path")
    prec = resolve_precision(precision, dtype)
    # "~/models/dgemma" works as README writes it; a missing path, a FIFO, a device or a link
    # loop is named for what it is, before any work
    p = check_model_path(path, "model")
    requested = (precision if isinstance(precision, str) else precision.name) or "auto"
    if plan is None:  # under mlx.launch: this rank's share, and one precision agreed by every rank
        plan = plan_load(p, requested, memory_limit)
    else:
        _check_plan(plan, p, requested)
    with plan.source:  # its file is closed once read, or if the load fails
        if plan.chosen != prec.name:
            prec = resolve_precision(plan.chosen, dtype)
        if prec.repack and plan.row(prec.name).repacked is False:  # fast fits, its 8-bit repack does not
            prec = replace(prec, repack=False)
            log.warning(plan.repack_note())
        plan.source.read = True
        model, tokenizer, gen = _read(plan.source, prec, progress)
    return Runtime(model, tokenizer, gen, prec, memory_limit=memory_limit)


def _check_plan(plan: Plan, path: Path, requested: str) -> None:
    """A plan given to :func:`load` is :func:`plan_load`'s, of this model and precision, unread."""
    source = getattr(plan, "source", None)
    if not isinstance(source, ModelSource) or plan.chosen is None:
        raise ParameterError("load(): plan: expected the plan of loader.plan_load(path, precision), which carries "
                             "the opened model and the precision chosen", param="plan")
    if source.path.resolve() != path.resolve():
        raise ParameterError(f"load(): plan: it is the plan of {source.path}, not of {path}; plan this model",
                             param="plan")
    if requested not in ("auto", plan.chosen):
        raise ParameterError(f"load(): plan: it chose --precision {plan.chosen}, not {requested}; load that, "
                             "or plan again", param="plan")
    if source.read:
        raise ParameterError(f"load(): plan: {path} was already loaded from this plan (a plan loads once); "
                             "plan again", param="plan")


def _read(source: ModelSource, prec: Precision, progress: Callable[[int, int, str], None] | None = None,
          layers: int | None = None) -> tuple[DiffusionGemma, Tokenizer, dict]:
    """(model, tokenizer, generation defaults) of a model opened and checked once (``source``):
    a directory or a .gguf (``layers``: its first)."""
    p = source.path
    if source.config is not None:
        model, _ = load_dir(p, precision=prec, layers=layers, config=source.config)
        tokenizer = Tokenizer.from_dir(p)
        gen_file = p / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    else:
        model, _, side = load_gguf(p, precision=prec, progress=progress, layers=layers, source=source.gguf)
        tokenizer = Tokenizer(side["tokenizer"], side.get("chat_template"))
        gen = side["generation_config"]
    return model, tokenizer, gen


def load_layers(path: str | Path, layers: int, precision: str | Precision = "exact",
                progress: Callable[[int, int, str], None] | None = None) -> Runtime:
    """The first ``layers`` layers of the model at ``path`` (``mlx-dgemma doctor``'s checks and
    timings), read as :func:`load` reads the whole model: a converted directory's files (only
    those layers' weights are read), or a .gguf converted in memory (all of it, the rest then
    dropped); in ``precision``'s runtime form. Not planned: a few layers fit where the whole
    model may not, and the checks are what the memory plan cannot tell."""
    if not isinstance(layers, int) or layers < 1:
        raise ParameterError(f"load_layers(): layers {layers!r}: must be a whole number of layers >= 1",
                             param="layers")
    prec = resolve_precision(precision)
    with ModelSource.open(path) as source:
        model, tokenizer, gen = _read(source, prec, progress, layers)
    return Runtime(model, tokenizer, gen, prec)


def load_demo(dtype: mx.Dtype | str | None = None, kind: str = "trained", precision: str | Precision = "auto",
              memory_limit: int | None = None, plan: Plan | None = None) -> Runtime:
    """The :class:`Runtime` of the built-in demo model ``kind`` ('trained' or 'random', see
    :mod:`mlx_dgemma.demo`) in runtime ``precision``; its ``demo_kind`` names the kind. It is
    planned as :func:`load` plans any model (against ``memory_limit`` bytes, or the device),
    unless ``plan`` is its plan already (:func:`plan_load` of its file)."""
    from .demo import demo_file

    return replace(load(demo_file(kind), precision=precision, dtype=dtype, memory_limit=memory_limit, plan=plan),
                   demo_kind=kind)


# --------------------------------------------------------------------------------------------
# The one loader of the front ends (CLI, chat app, server): --model or --demo, --precision and
# --dtype, with the same checks and errors everywhere. Imports are lazy (nothing above is used).


def open_model(model: str | None, demo: bool, precision: str = "auto", dtype: str | None = None,
               progress: Callable[[int, int, str], None] | None = None,
               memory_limit: int | None = None, plan: Plan | None = None) -> Runtime:
    """The :class:`Runtime` of a front end: the built-in demo model if ``demo``, else ``model``
    (a converted directory or a .gguf, ``~`` expanded; default ``$MLX_DGEMMA_MODEL``), in
    runtime ``precision`` (``dtype``: fast's activation dtype). ``progress(i, n, tensor)``
    follows a .gguf's in-memory conversion. ``plan``: the front end's own plan of this model
    (:func:`plan_load`, made before it started), which the load reads instead of planning again.

    A contradictory precision, both or neither model, a path that is missing or not a file or
    directory are errors before any loading.

    Under ``mlx.launch`` every rank's checks, then every rank's load, must succeed, or all
    raise (``distributed.agree``): one rank failing alone leaves none waiting for it.
    """
    from mlx_dgemma.distributed import agree_startup, tell_startup_failure
    from mlx_dgemma.errors import DGemmaError
    from mlx_dgemma.precision import resolve_precision

    try:
        resolve_precision(precision, dtype)  # a bad precision or dtype is refused before the load
        path = resolve_model(model, demo)
        agree_startup()  # every rank found its model: load
        if demo:  # auto planned like any model's (resolving it first settled it as fast)
            loaded = load_demo(dtype=dtype, precision=precision, memory_limit=memory_limit, plan=plan)
        else:
            loaded = load(path, precision=precision, dtype=dtype, progress=progress, memory_limit=memory_limit,
                          plan=plan)
    except DGemmaError as e:
        tell_startup_failure(e)
        raise
    agree_startup(last=True)  # every rank holds its slices
    return loaded
