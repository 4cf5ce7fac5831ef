"""Runtime precision: ``exact``, ``fast``, the memory tiers ``q4`` and ``q3``, or ``auto``.

What each precision stores for each weight is declared once, in :mod:`mlx_dgemma.tiers` (NumPy,
shared with ``convert --precision``); this module applies it to a loaded model, in memory:

* ``exact``: float32 activations; every quantized weight's scales and biases as stored
  (float32 for K-quants), padded 16-element sub-blocks kept, so each dequantized weight is
  bit-identical to gguf-py's. What ``verify`` and the parity tests hold to.
* ``fast``: activations in the device's fast dtype (bfloat16 on a GPU, float32 on MLX's CPU
  backend, whose half-precision kernels are 10-40x slower than float32 ones); every quantized
  weight's scales and biases cast to that dtype, so no quantized matmul is promoted back to
  float32 (on a GPU, ``gather_qmm`` with float32 scales runs 4-6x slower); and the tensors with
  16-element sub-blocks (Q2_K, Q3_K, Q6_K: the Q6_K embedding is the output head and the
  self-conditioning matrix) re-quantized to unpadded 8-bit groups of 32 (from the packed
  integers, on threads; from an exact directory, read instead from the sidecar its conversion
  wrote, :mod:`mlx_dgemma.sidecar`), so the head and
  self-conditioning do their multiply-adds once instead of over a zero-padded matrix twice as
  wide; and self-conditioning from each position's ``FAST_SC_TOP_K`` most likely tokens
  instead of the whole vocabulary. Approximate; the error against exact is measured (README,
  ``bench``, benchmarks/RESULTS.md "The dial") and bounded in tests. On a GPU (Metal or CUDA)
  also the 5-bit legacy weights (Q5_0, Q5_1: the published file's down projections in 16 of its
  30 layers) repacked to 8-bit groups of 32 with the same scales and biases, the same values bit
  for bit (:data:`mlx_dgemma.tiers.REPACK_TYPES`), where the memory plan says the 3 more bits a
  weight fit (``Precision.repack``); on MLX's CPU backend they stay 5-bit (benchmarks/repack.py).
* ``q4`` / ``q3``: fast's activations and self-conditioning, and the weights re-quantized by the tier's recipe
  (:func:`mlx_dgemma.tiers.target`) with float16 scales (cast to the activation dtype on a GPU;
  kept float16 on the CPU, where they cost half the memory and MLX upcasts them per call).
* ``auto`` (the default): ``fast``; when the loader's memory plan says fast does not fit, the
  most exact tier that does (:mod:`mlx_dgemma.plan`).

A converted directory holds one of these forms (config.json's ``mlx_dgemma.weights``); it can
be loaded in that precision or a less exact one, never a more exact one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

import numpy as np

from .errors import ModelFilesError, ParameterError
from .gpu import keep_float32_exact
from .schema import QuantSpec
from .sidecar import StoredWeight, goal_for, requantize_tensors, usable_sidecar
from .tiers import (AUTO_ORDER, FAST_BITS, FAST_GROUP, PRECISIONS, REPACK_BITS, TIERS, Target, Tier,
                    check_precision_dtype, repacked, stored_precision, tier)

log = logging.getLogger("mlx_dgemma.precision")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
__all__ = ["DTYPES", "FAST_BITS", "FAST_GROUP", "PRECISIONS", "TIERS", "Precision", "apply_precision",
           "fast_dtype", "gpu_available", "quantized_dtype_report", "resolve_precision", "stored_precision"]

# Sparse self-conditioning in fast: softmax(logits) @ E over each position's 64 most likely
# tokens (renormalized) instead of all V. On the trained demo (benchmarks/dial.py sc, 8 prompts,
# 4,192 positions along real generations) k = 32, 64 and 256 all kept 100 % top-1 agreement with
# exact self-conditioning and identical answers; 64 rather than 32 for a 4.5x smaller logit
# error (1.9e-4 vs 8.3e-4) at a cost still ~4,000x below the full product at vocab 262,144.
FAST_SC_TOP_K = 64


@dataclass(frozen=True)
class Precision:
    """A resolved runtime precision: ``name`` one of :data:`TIERS`, ``dtype`` the activations'."""

    name: str
    dtype: mx.Dtype
    sc_top_k: int | None = None  # self-conditioning from the top k tokens (None = exact)
    # fast's 5-bit legacy weights repacked to 8 bits (lossless): on a GPU, unless the memory plan
    # says they do not fit (the loader then turns it off and says so)
    repack: bool = False

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    @property
    def label(self) -> str:
        """For status lines and JSON: "fast (bfloat16)", "exact (float32)", "q4 (float32)"."""
        return f"{self.name} ({self.dtype_name})"

    @property
    def tier(self) -> Tier:
        """Its row (:data:`mlx_dgemma.tiers.TIER_ROWS`): what it stores for each weight."""
        return tier(self.name)

    @property
    def lossy_weights(self) -> bool:
        """Weights re-quantized (the tiers), not just scales rounded."""
        return self.tier.requantizes


def gpu_available() -> bool:
    """True when MLX's default device is a GPU (Metal on a Mac, CUDA on Linux)."""
    return mx.default_device() == mx.gpu


def fast_dtype() -> mx.Dtype:
    """The activation dtype ``fast`` uses on this machine."""
    return mx.bfloat16 if gpu_available() else mx.float32


def resolve_precision(precision: str | Precision | None = "auto", dtype: str | mx.Dtype | None = None) -> Precision:
    """``precision`` (auto/exact/fast/q4/q3) and an optional activation ``dtype`` -> :class:`Precision`.

    ``auto`` resolves to ``fast`` here (the loader's memory plan may pick a smaller tier).
    ``dtype`` only chooses the activation dtype of the lossy precisions (default: :func:`fast_dtype`);
    ``exact`` is float32 by definition, so ``exact`` with another dtype is an error rather than
    a silent contradiction.
    """
    if isinstance(precision, Precision):
        return precision
    name = precision or "auto"
    if name not in PRECISIONS:
        raise ParameterError(f"--precision: {name!r} is not one of {', '.join(PRECISIONS)}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ParameterError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    row = tier(AUTO_ORDER[0] if name == "auto" else name)
    if row.lossless:
        check_precision_dtype(name, None if dtype is None else str(dtype).split(".")[-1])
        return Precision(row.name, mx.float32)
    return Precision(row.name, dtype if dtype is not None else fast_dtype(), FAST_SC_TOP_K,
                     repack=row.repack and gpu_available())


def check_loadable(stored: str, precision: Precision, source: str) -> None:
    """A directory converted to ``stored`` can run in that precision or a less exact one."""
    if TIERS.index(precision.name) < TIERS.index(stored):
        raise ParameterError(f"--precision {precision.name}: {source} holds {stored} weights (converted with "
                             f"--precision {stored}), which cannot be made more exact; use --precision "
                             f"{stored} (or auto), or convert the GGUF again with --precision {precision.name}")


# --------------------------------------------------------------------------------------------
# applying a precision to a loaded (exact) model


def _is_quantized(m: nn.Module) -> bool:
    return "scales" in m and hasattr(m, "bits") and hasattr(m, "subblock")


def _requantize_modules(todo: list[tuple[str, nn.Module, Target]]) -> None:
    """Each (path, quantized module, goal) of ``todo``: the module's weight -> ``goal``'s form,
    in place, through the one pass over stored weights (:func:`mlx_dgemma.sidecar.requantize_tensors`,
    NumPy: the same numbers ``convert --precision`` and fast's sidecar hold), reading the loaded
    arrays where they are (no copy; fast's pairs make no float copy of the weight either). Each
    module takes its new arrays, freeing its old ones, as soon as its last slice is done."""
    stored: list[StoredWeight | None] = []
    for path, m, goal in todo:
        arrays = [m[n] if m[n].dtype != mx.bfloat16 else m[n].astype(mx.float32) for n in ("weight", "scales", "biases")]
        mx.eval(*arrays)
        w, s, b = (np.asarray(a) for a in arrays)  # views of MLX's buffers
        stored.append(StoredWeight(path, w, s, b, m.bits, m.group_size, m.subblock, goal))
    try:
        for k, arrays in requantize_tensors(stored):
            _, m, goal = todo[k]
            _install(m, goal, [mx.array(a) for a in arrays])
    except OverflowError as e:  # as convert --precision refuses it: one line naming the weight
        raise ModelFilesError(f"{e}; load it with --precision exact") from None


def _install(m: nn.Module, goal: Target, arrays: list[mx.array]) -> None:
    m.weight, m.scales, m.biases = arrays
    m.bits, m.group_size, m.subblock = goal.bits, goal.group_size, 32
    mx.eval(m.weight, m.scales, m.biases)


def _take_sidecar(todo: list[tuple[str, nn.Module, Target]], model_dir: Path,
                  config: dict) -> list[tuple[str, nn.Module, Target]]:
    """fast's weights of ``todo`` from ``model_dir``'s sidecar (:mod:`mlx_dgemma.sidecar`) when
    it is recorded, matches and is intact; returns what is left to re-quantize (all of ``todo``
    when the file cannot be used: nothing is taken from it then)."""
    if not todo:
        return todo
    f, problem = usable_sidecar(model_dir, config, {path: goal for path, _, goal in todo})
    if f is None:
        if problem is not None:
            log.warning("%s", problem)
        return todo
    arrays = mx.load(str(f))  # lazy: read one module's arrays at a time below
    for path, m, goal in todo:  # every shape right before any module changes
        lead, n = m["weight"].shape[:-1], m["weight"].shape[-1] * 32 // m.bits // (2 if m.subblock == 16 else 1)
        want = [(*lead, n * goal.bits // 32), (*lead, n // goal.group_size), (*lead, n // goal.group_size)]
        got = [tuple(arrays[f"{path}.{k}"].shape) if f"{path}.{k}" in arrays else None
               for k in ("weight", "scales", "biases")]
        if got != want:
            log.warning("%s: %s is stored with shapes %s, this model's need %s, so the file is not used: "
                        "re-quantizing instead; deleting it or converting the model again ends this", f, path, got, want)
            return todo
    for path, m, goal in todo:
        _install(m, goal, [arrays.pop(f"{path}.{k}") for k in ("weight", "scales", "biases")])
    return []


def _repack_modules(modules: list[nn.Module]) -> None:
    """Each 5-bit module's integers -> :data:`REPACK_BITS`-bit groups of the same size, scales and
    biases untouched: the same dequantized values bit for bit. On the device (GPU: a pass over
    the weight), a slice of rows at a time: the integers come out of ``mx.dequantize`` with unit
    scales and zero biases (float32 holds 0..31 exactly) and are stored one byte each, MLX's
    8-bit layout (little-endian bytes of each uint32)."""
    for m in modules:
        w = m["weight"]
        n = w.shape[-1] * 32 // m.bits
        rows = w.reshape(-1, w.shape[-1])
        step = max(1, (1 << 24) // n)  # ~16 M weights a slice: a 64 MB float32 temporary
        parts = []
        for i in range(0, rows.shape[0], step):
            part = rows[i:i + step]
            ones = mx.ones((part.shape[0], n // m.group_size), mx.float32)
            q = mx.dequantize(part, ones, mx.zeros_like(ones), group_size=m.group_size, bits=m.bits)
            parts.append(q.astype(mx.uint8).view(mx.uint32))
            mx.eval(parts[-1])
        m.weight = (mx.concatenate(parts) if len(parts) > 1 else parts[0]).reshape(*w.shape[:-1], -1)
        m.bits = REPACK_BITS
        del w, rows, parts
        mx.eval(m.weight)


def apply_precision(model: nn.Module, precision: Precision, quantization: dict | None = None,
                    model_dir: Path | None = None, config: dict | None = None) -> None:
    """Turn a loaded model into ``precision``'s runtime form, in memory.

    ``exact`` changes nothing in the model (on a Mac's GPU it keeps float32 matmuls IEEE float32:
    :func:`mlx_dgemma.gpu.keep_float32_exact`). The others re-quantize the weights their recipe names
    (``mlx_dgemma.tiers.target``; ``quantization`` is config.json's section, which records each
    weight's ggml type) unless already in that form, cast every quantized weight's scales and
    biases (the tiers' float16 ones only to a half-precision activation dtype) and every float
    parameter to ``precision.dtype`` (quantized weights' packed integers are untouched), and
    the model's own ``activation_dtype``; with ``precision.repack``, repacks fast's 5-bit
    legacy weights to 8 bits (lossless). ``fast`` takes its re-quantized weights from an exact
    directory's sidecar (``model_dir``, its ``config``) when that file matches. The precision itself is the caller's to keep with the
    model (the loader's :class:`mlx_dgemma.runtime.Runtime`), as are steps traced before.
    """
    if precision.tier.lossless:
        keep_float32_exact()  # before its first matmul: float32 stays IEEE on an M5-class GPU too
        return
    dt = precision.dtype
    specs = {k: QuantSpec.from_dict(v) for k, v in (quantization or {}).items() if isinstance(v, dict)}
    layers = model.args.num_hidden_layers
    model.activation_dtype = dt
    quantized = [(path, m) for path, m in model.named_modules() if _is_quantized(m)]
    todo = []
    for path, m in quantized:
        goal = goal_for(precision.name, path, specs.get(path), m.bits, m.group_size, m.subblock,
                        m["weight"].shape[-1], layers)
        if goal is not None:
            todo.append((path, m, goal))
    if precision.tier.padded and model_dir is not None and config is not None \
            and tier(stored_precision(config)).lossless:
        todo = _take_sidecar(todo, model_dir, config)
    _requantize_modules(todo)
    if precision.repack:
        _repack_modules([m for path, m in quantized if (m.bits, m.group_size, m.subblock) == (5, 32, 32)
                         and path in specs and repacked(precision.name, specs[path].ggml_type)])
    for path, m in quantized:
        # the tiers' float16 scales stay float16 beside float32 activations (half the memory)
        keep = precision.lossy_weights and dt == mx.float32 and m["scales"].dtype == mx.float16
        if m["scales"].dtype != dt and not keep:
            m.scales = m["scales"].astype(dt)
            if m.get("biases") is not None:
                m.biases = m["biases"].astype(dt)

    def cast(path: str, a: mx.array) -> mx.array:
        if path.endswith((".scales", ".biases")):
            return a  # decided above
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dt:
            return a.astype(dt)
        return a

    model.update(tree_map_with_path(cast, model.parameters()))
    mx.eval(model.parameters())
    # what this conversion freed (the exact weights it replaced, its temporaries) stays in MLX's
    # buffer cache, counted against the device's memory, until given back
    mx.clear_cache()


def quantized_dtype_report(model: nn.Module) -> list[tuple[str, str, int, int]]:
    """(module path, scales dtype, bits, sub-block) of every quantized layer (tests, bench)."""
    return [(p, str(m["scales"].dtype).split(".")[-1], m.bits, m.subblock)
            for p, m in model.named_modules() if _is_quantized(m)]
