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
  integers, on threads: a small part of the load's time), so the head and
  self-conditioning do their multiply-adds once instead of over a zero-padded matrix twice as
  wide; and self-conditioning from each position's ``FAST_SC_TOP_K`` most likely tokens
  instead of the whole vocabulary. Approximate; the error against exact is measured (README,
  ``bench``, benchmarks/RESULTS.md "The dial") and bounded in tests.
* ``q4`` / ``q3``: fast's activations and self-conditioning, and the weights re-quantized by the tier's recipe
  (:func:`mlx_dgemma.tiers.target`) with float16 scales (cast to the activation dtype on a GPU;
  kept float16 on the CPU, where they cost half the memory and MLX upcasts them per call).
* ``auto`` (the default): ``fast``; when the loader's memory plan says fast does not fit, the
  most exact tier that does (:mod:`mlx_dgemma.plan`).

A converted directory holds one of these forms (config.json's ``mlx_dgemma.weights``); it can
be loaded in that precision or a less exact one, never a more exact one.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

import numpy as np

from .errors import ModelFilesError, ParameterError
from .gpu import keep_float32_exact
from .schema import QuantSpec
from .tiers import (FAST_BITS, FAST_GROUP, PRECISIONS, TIERS, Requantized, Target, check_precision_dtype,
                    ordered_map, requantize_stored, stored_precision, target)

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

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    @property
    def label(self) -> str:
        """For status lines and JSON: "fast (bfloat16)", "exact (float32)", "q4 (float32)"."""
        return f"{self.name} ({self.dtype_name})"

    @property
    def lossy_weights(self) -> bool:
        """Weights re-quantized (the tiers), not just scales rounded."""
        return self.name in ("q4", "q3")


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
    if name == "exact":
        check_precision_dtype(name, None if dtype is None else str(dtype).split(".")[-1])
        return Precision("exact", mx.float32)
    return Precision("fast" if name == "auto" else name, dtype if dtype is not None else fast_dtype(), FAST_SC_TOP_K)


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
    in place, through the one re-quantizer (:func:`mlx_dgemma.tiers.requantize_stored`, NumPy:
    the same numbers ``convert --precision`` writes), reading the loaded arrays where they are
    (no copy; fast's pairs make no float copy of the weight either).

    The weights are cut in slices along their leading axis (experts or rows), all of them shared
    by one pool of threads (small tensors are done beside large ones); the float temporaries
    alive at once are a few slices', not a tensor's (the real embedding is 3 GB in float32), and
    each module takes its new arrays, freeing its old ones, as soon as its last slice is done."""
    views: list[tuple[np.ndarray, ...] | None] = []
    jobs: list[tuple[int, int, int]] = []  # (module, first row, rows)
    for k, (_, m, _) in enumerate(todo):
        arrays = [m[n] if m[n].dtype != mx.bfloat16 else m[n].astype(mx.float32) for n in ("weight", "scales", "biases")]
        mx.eval(*arrays)
        w = np.asarray(arrays[0])  # views of MLX's buffers
        views.append((w, np.asarray(arrays[1]), np.asarray(arrays[2])))
        step = max(1, (1 << 20) // max(1, w[0].size * 32 // m.bits))  # ~1 M weights a slice
        jobs += [(k, i, step) for i in range(0, w.shape[0], step)]

    def run(job: tuple[int, int, int]) -> Requantized:
        k, i, n = job
        path, m, goal = todo[k]
        w, s, b = views[k]
        try:
            return requantize_stored(w[i:i + n], s[i:i + n], b[i:i + n], m.bits, m.group_size, m.subblock, goal)
        except OverflowError as e:  # as convert --precision refuses it: one line naming the weight
            raise ModelFilesError(f"{path}.weight: {e}; load it with --precision exact") from None

    left = [sum(1 for j in jobs if j[0] == k) for k in range(len(todo))]
    out: list[list[np.ndarray]] = [[] for _ in todo]
    for (k, i, n), r in zip(jobs, ordered_map(run, jobs)):
        arrays = (r.weight, r.scales, r.biases)
        if not out[k]:
            lead = views[k][0].shape[0]
            out[k] = [np.empty((lead, *a.shape[1:]), dtype=a.dtype) for a in arrays]
        for o, a in zip(out[k], arrays):
            o[i:i + n] = a
        left[k] -= 1
        if not left[k]:
            _, m, goal = todo[k]
            views[k] = None
            m.weight, m.scales, m.biases = (mx.array(a) for a in out[k])
            m.bits, m.group_size, m.subblock = goal.bits, goal.group_size, 32
            mx.eval(m.weight, m.scales, m.biases)
            out[k] = []


def _goal(precision: str, path: str, m: nn.Module, specs: dict[str, QuantSpec], num_layers: int) -> Target | None:
    spec = specs.get(path)
    if spec is not None and spec.ggml_type:
        width = m["weight"].shape[-1] * 32 // m.bits // (2 if m.subblock == 16 else 1)
        return target(precision, path, spec.ggml_type, num_layers, width)
    # no ggml type recorded: only fast's rule can be applied (padded sub-blocks are its trigger)
    return Target(FAST_BITS, FAST_GROUP) if precision == "fast" and m.subblock == 16 else None


def apply_precision(model: nn.Module, precision: Precision, quantization: dict | None = None) -> None:
    """Turn a loaded model into ``precision``'s runtime form, in memory.

    ``exact`` changes nothing in the model (on a Mac's GPU it keeps float32 matmuls IEEE float32:
    :func:`mlx_dgemma.gpu.keep_float32_exact`). The others re-quantize the weights their recipe names
    (``mlx_dgemma.tiers.target``; ``quantization`` is config.json's section, which records each
    weight's ggml type) unless already in that form, cast every quantized weight's scales and
    biases (the tiers' float16 ones only to a half-precision activation dtype) and every float
    parameter to ``precision.dtype`` (quantized weights' packed integers are untouched), and
    the model's own ``activation_dtype``. The precision itself is the caller's to keep with the
    model (the loader's :class:`mlx_dgemma.runtime.Runtime`), as are steps traced before.
    """
    if precision.name == "exact":
        keep_float32_exact()  # before its first matmul: float32 stays IEEE on an M5-class GPU too
        return
    dt = precision.dtype
    specs = {k: QuantSpec.from_dict(v) for k, v in (quantization or {}).items() if isinstance(v, dict)}
    layers = model.args.num_hidden_layers
    model.activation_dtype = dt
    quantized = [(path, m) for path, m in model.named_modules() if _is_quantized(m)]
    todo = []
    for path, m in quantized:
        goal = _goal(precision.name, path, m, specs, layers)
        if goal is not None and (m.bits, m.group_size, m.subblock) != (goal.bits, goal.group_size, 32):
            todo.append((path, m, goal))
    _requantize_modules(todo)
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
