"""``mlx-dgemma doctor``'s rows about the machine: the device (MLX's backend, a Mac's NAX units),
the memory the default device may use, the CUDA kernel cache, and which precision of a model
fits (the loader's own memory plan, :func:`mlx_dgemma.loader.plan_model`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dgemma.gpu import device_nax

# --------------------------------------------------------------------------------------------
# the machine


def backend_name() -> str:
    """"cpu" where MLX's default device is the CPU, else "metal", "cuda" (or "gpu")."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "gpu"


@dataclass(frozen=True)
class DeviceInfo:
    default_device: str  # "cpu" or "gpu"
    backend: str
    gpu: bool
    name: str
    mlx_version: str
    architecture: str = ""  # Metal's, e.g. "applegpu_g17s" (MLX's device_info)
    nax: bool = False  # the GPU's NAX units would run float32 matmuls at reduced precision (mlx_dgemma.gpu)


def device_info() -> DeviceInfo:
    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except (AttributeError, RuntimeError):  # pragma: no cover - older MLX
        pass
    b = backend_name()
    name = str(info.get("device_name") or info.get("architecture") or "unknown")
    return DeviceInfo("cpu" if b == "cpu" else "gpu", b, b != "cpu", name, mx.__version__,
                      str(info.get("architecture", "")), b == "metal" and device_nax())


@dataclass(frozen=True)
class MemoryInfo:
    """What the default device may use: ``bytes`` (None when unknown) and where it came from."""

    kind: str
    bytes: int | None
    note: str = ""


def usable_memory() -> MemoryInfo:
    """Metal: the recommended working set; CUDA: the device's free memory; CPU: available RAM."""
    # The CPU's row is the loader's budget (mlx_dgemma.memory). A GPU's is not memory.device_budget
    # on purpose: that is what a model may take now (less what MLX holds; on CUDA 95 % of the total,
    # MLX's allocator cap, bounded by the free memory), read only when MLX's default device is the
    # GPU; this row states the device's own figure, as its vendor names it (nvidia-smi's free
    # memory where MLX reports none), for the backend doctor found, so that a report shows the
    # device as it is. Making it the budget would change the row's numbers and labels (issue 34
    # asked for no behaviour change in this split).
    from mlx_dgemma.memory import available_bytes

    b = backend_name()
    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except (AttributeError, RuntimeError):  # pragma: no cover
        pass
    if b == "metal":
        n = info.get("max_recommended_working_set_size") or info.get("memory_size")
        return MemoryInfo("Metal recommended working set", int(n) if n else None)
    if b in ("cuda", "gpu"):
        for k in ("free_memory", "memory_free"):
            if info.get(k):
                return MemoryInfo("CUDA free memory", int(info[k]))
        free = _nvidia_smi_free()
        if free is not None:
            return MemoryInfo("CUDA free memory", free, "nvidia-smi")
        total = info.get("total_memory") or info.get("memory_size")
        return MemoryInfo("GPU total memory", int(total) if total else None, "free memory not reported")
    return MemoryInfo("available RAM", available_bytes(), "MemAvailable, bounded by a container limit")


def _nvidia_smi_free() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class KernelCache:
    """MLX's CUDA backend compiles kernels at first use (~40 s each) and caches them on disk."""

    applies: bool
    dir: str | None = None
    files: int = 0
    bytes: int = 0
    note: str = ""


def kernel_cache() -> KernelCache:
    """The CUDA kernel cache: ``MLX_PTX_CACHE_DIR``, default ``<tmp>/mlx/<version>/ptx``."""
    if backend_name() not in ("cuda", "gpu"):
        return KernelCache(False, note="only MLX's CUDA backend compiles kernels at first use")
    d = Path(os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx")
    files = [p for p in d.rglob("*") if p.is_file()] if d.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    note = ("empty: the first run compiles each kernel (~40 s each, minutes in all); set MLX_PTX_CACHE_DIR to a "
            "lasting directory to keep them" if not files else "warm: cached kernels load in ~0.1 s")
    return KernelCache(True, str(d), len(files), size, note)

# --------------------------------------------------------------------------------------------
# which precision of a model fits: the loader's own memory plan (`mlx-dgemma plan`)

FIT_PROMPT_TOKENS = 512  # the memory-tiers issue's reference context: 512 cached tokens, one canvas


@dataclass(frozen=True)
class PrecisionFit:
    precision: str  # "exact", "fast", "q4", "q3"
    needed_bytes: int
    fits: bool | None  # None: the memory available is unknown; False also where the stored form is lossier


@dataclass(frozen=True)
class Fit:
    model: str
    weights_bytes: int  # of the form stored on disk (exact for a .gguf)
    available_bytes: int | None
    available_kind: str
    precisions: list[PrecisionFit]


def precision_fit(path: Path, memory: MemoryInfo) -> Fit:
    """Which runtime precision of the model at ``path`` fits the memory the device may use:
    the memory plan the loader applies (:func:`mlx_dgemma.loader.plan_model`: weights, KV cache
    for :data:`FIT_PROMPT_TOKENS` tokens, a step's working memory, the peak while loading)
    against ``memory``. Reads no weights."""
    from mlx_dgemma.loader import plan_model

    plan = plan_model(path, memory.bytes, FIT_PROMPT_TOKENS)
    stored = plan.stored if plan.stored in {r.precision for r in plan.rows} else "exact"
    rows = [PrecisionFit(r.precision, r.needed_bytes,
                         (r.fits if memory.bytes is not None else None) if r.loadable else False)
            for r in plan.rows]
    return Fit(str(path), plan.row(stored).weights_bytes, memory.bytes, memory.kind, rows)
