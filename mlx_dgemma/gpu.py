"""What MLX's GPU backends need beyond the CPU's, Metal's foremost (read in MLX 0.32's source):

* **exact stays float32 on M5-class GPUs.** From MLX 0.30.1, on macOS 26.2 or later with a GPU
  of architecture generation 17 or later (``applegpu_g17*``; 18 for phone-class ``*p``
  parts), float32 matmuls (dense, quantized and gathered, attention) run on the GPU's neural
  accelerators (NAX) at reduced, TF32-like precision unless ``MLX_ENABLE_TF32=0``
  (``metal::is_nax_available`` in mlx/backend/metal/device.cpp; ``env::enable_tf32()`` in
  mlx/utils.h). MLX reads the variable once, lazily: a function-local static first evaluated by
  the first matmul-family kernel on such a device, not by ``import mlx.core``. So
  :func:`keep_float32_exact` sets it before a model in ``exact`` computes anything (the
  precision applied to it, and doctor before its checks); in a process that already ran a
  matmul on the GPU it comes too late, which doctor's float32 matmul check shows. Bfloat16 and
  float16 matmuls use NAX either way (``fast`` is unaffected); CUDA's TF32 is left as it is.
* **generation under the wired limit** (:func:`wired_limit`), as mlx-lm's generation runs.
* **a GPU out of memory is the one-line budget error** (:func:`memory_errors`): MLX raises
  ``RuntimeError`` when an allocation fails (``[malloc] Unable to allocate N bytes``, or over
  the device's largest buffer or resource count) or when a command buffer fails for lack of
  memory (``[METAL] Command buffer execution failed: Insufficient Memory``); MLX before 0.30
  aborted the process there instead.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from .errors import MemoryBudgetError

log = logging.getLogger("mlx_dgemma.gpu")

TF32_ENV = "MLX_ENABLE_TF32"
# NAX: the first MLX release with the macOS check (0.30.0 had it behind a build flag only)
NAX_MLX, NAX_MACOS = (0, 30, 1), (26, 2)
# mlx-lm's threshold for its warning: weights above this share of the working set
NEAR_LIMIT = 0.9


def _version(text: str) -> tuple[int, ...]:
    """"0.32.4" -> (0, 32, 4); "26.2" -> (26, 2); the leading numbers only ("0.33.0.dev1" -> (0, 33, 0))."""
    out = []
    for part in text.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def nax_capable(architecture: str, macos: str, mlx_version: str) -> bool:
    """Whether MLX (``mlx_version``) on macOS ``macos`` runs float32 matmuls on the NAX units of a
    GPU whose Metal architecture is ``architecture`` (``mx.device_info()["architecture"]``, e.g.
    ``applegpu_g17s``), unless ``MLX_ENABLE_TF32=0``: MLX's own test, from its source (a wheel
    built without NAX, ``MLX_METAL_NO_NAX``, never does; nothing in Python tells)."""
    if _version(mlx_version) < NAX_MLX or not macos or _version(macos) < NAX_MACOS:
        return False
    if len(architecture) < 3 or not architecture[-3:-1].isdigit():
        return False
    generation = int(architecture[-3:-1])
    return generation >= (18 if architecture.endswith("p") else 17)


def device_nax() -> bool:
    """This machine's GPU takes float32 matmuls to NAX by default (:func:`nax_capable`)."""
    if not mx.metal.is_available():
        return False
    try:
        arch = str(mx.device_info().get("architecture", ""))
    except (AttributeError, RuntimeError):  # pragma: no cover - MLX before device_info
        return False
    return nax_capable(arch, platform.mac_ver()[0], mx.__version__)


def keep_float32_exact() -> None:
    """Keep float32 matmuls IEEE float32 on a Mac's GPU (``MLX_ENABLE_TF32=0``), before the first
    one runs: what ``exact`` promises. A value the user set is overridden (exact is float32 by
    definition; a faster float32 is ``--precision fast --dtype float32``)."""
    if mx.metal.is_available() and os.environ.get(TF32_ENV) != "0":
        os.environ[TF32_ENV] = "0"  # putenv: what MLX's getenv reads at its first matmul


def _weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array))


_warned: set[str] = set()


@contextmanager
def wired_limit(model) -> Iterator[None]:
    """Run the block under MLX's wired limit, as ``mlx_lm.generate.wired_limit`` does around its
    generation: on Metal the limit is raised to the recommended working set (the model's
    buffers stay resident instead of being paged or compressed between steps: a model near the
    limit, q4 on a 24 GB Mac, fast on a 32 GB one), then, after a synchronize (MLX: the limit
    must not change under a running evaluation), set back. Call it on the thread that
    generates. Elsewhere it does nothing. Logs a warning, once per model size, when the weights
    alone take more than 90 % of the working set."""
    if not mx.metal.is_available():
        yield
        return
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    weights = _weights_bytes(model)
    if weights > NEAR_LIMIT * limit:
        from .memory import gb

        text = (f"warning: the model's weights ({gb(weights)}) take over {NEAR_LIMIT:.0%} of Metal's recommended "
                f"working set ({gb(limit)}): generation can slow down as macOS pages memory; a smaller precision "
                "leaves room (`mlx-dgemma plan MODEL` lists them)")
        if text not in _warned:
            _warned.add(text)
            log.warning(text)
    old = mx.set_wired_limit(limit)
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)


# What MLX's RuntimeError says when the GPU's memory runs out (0.32: metal/allocator.cpp,
# metal/device.cpp, cuda/allocator.cpp).
_OUT_OF_MEMORY = re.compile(r"\[(metal::)?malloc\]|Insufficient Memory|OutOfMemory|out of memory", re.IGNORECASE)


def out_of_memory(e: BaseException) -> bool:
    """``e`` is MLX saying the device ran out of memory (or of buffers)."""
    return isinstance(e, RuntimeError) and bool(_OUT_OF_MEMORY.search(str(e)))


@contextmanager
def memory_errors(what: str) -> Iterator[None]:
    """A GPU out of memory inside the block becomes :class:`MemoryBudgetError`, the one line a
    user reads for any memory refusal (``what``: what was running, e.g. "generation"); other
    errors pass. Also a decorator (``@memory_errors("loading")``), for plain functions."""
    try:
        yield
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        said = str(e).strip().rstrip(".")
        raise MemoryBudgetError(f"{what}: the GPU ran out of memory (MLX: {said}); close other apps, or give it "
                                "less: a shorter prompt, fewer tokens to generate, or a smaller precision "
                                "(`mlx-dgemma plan MODEL` lists what fits)") from e
