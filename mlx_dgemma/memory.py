"""Memory estimates for a prompt, checked before any work is done.

The KV cache is exact (its shapes are known: ``window - 1`` ring slots on sliding layers,
every position rounded up to the bucket on global layers). The working memory is an upper
estimate of the largest transient buffers: one prefill chunk's activations and attention
scores (bounded by ``model.ATTENTION_SCORES_BUDGET``), or one denoising step's attention
over the whole cache plus its [canvas, vocab] logits, whichever is larger.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_dgemma.cache import DEFAULT_BUCKET
from mlx_dgemma.errors import MemoryBudgetError
from mlx_dgemma.model import ATTENTION_SCORES_BUDGET, DEFAULT_PREFILL_CHUNK, ModelArgs
from mlx_dgemma.rss import current_rss_bytes, peak_rss_bytes  # noqa: F401 (re-exported)

_F32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a prompt needs on top of what is already allocated (weights, an existing cache)."""

    kv_bytes: int  # the KV cache once the prompt and the answer's blocks are encoded
    prefill_working_bytes: int
    step_working_bytes: int
    existing_kv_bytes: int = 0  # already allocated (a chat session's cache)

    @property
    def working_bytes(self) -> int:
        return max(self.prefill_working_bytes, self.step_working_bytes)

    @property
    def needed_bytes(self) -> int:
        return max(0, self.kv_bytes - self.existing_kv_bytes) + self.working_bytes


def _layers(a: ModelArgs) -> list[tuple[bool, int, int]]:
    """(sliding, kv heads, head dim) per layer."""
    return [(a.is_sliding(i), a.num_key_value_heads if a.is_sliding(i) else a.num_global_key_value_heads,
             a.head_dim if a.is_sliding(i) else a.global_head_dim) for i in range(a.num_hidden_layers)]


def kv_cache_bytes(a: ModelArgs, positions: int, itemsize: int = _F32, bucket: int = DEFAULT_BUCKET) -> int:
    """The cache holding ``positions`` tokens: keys, values and slot positions."""
    total = 0
    for sliding, kv, d in _layers(a):
        slots = a.sliding_window - 1 if sliding else -(-positions // bucket) * bucket
        if positions > 0:
            total += slots * (2 * kv * d * itemsize + 4)
    return total


def _scores(heads: int, rows: int, keys: int) -> int:
    """Float32 scores of one attention call after ``bounded_attention`` splits its queries."""
    per_row = heads * keys * _F32
    return min(rows, max(1, ATTENTION_SCORES_BUDGET // per_row)) * per_row


def prefill_working_bytes(a: ModelArgs, positions: int, chunk: int, itemsize: int = _F32) -> int:
    """One chunk through one layer: activations, attention scores (plus masks and a copy of
    the keys and values read), expert gathers; the largest layer counts."""
    H, h = a.num_attention_heads, a.hidden_size
    acts = chunk * (8 * h + 3 * a.intermediate_size + a.num_experts
                    + a.top_k_experts * (3 * a.moe_intermediate_size + 2 * h)) * itemsize
    worst = 0
    for sliding, kv, d in _layers(a):
        keys = a.sliding_window - 1 + chunk if sliding else positions
        qkv = chunk * (H + 2 * kv) * d * itemsize
        read = 2 * kv * keys * d * itemsize  # keys and values gathered for the call
        mask = chunk * keys if sliding else 0
        worst = max(worst, qkv + read + mask + 2 * _scores(H, chunk, keys))
    return acts + worst


def step_working_bytes(a: ModelArgs, positions: int, canvas: int, itemsize: int = _F32) -> int:
    """One denoising step: attention of the canvas over the whole cache (not split), the
    cache copy the canvas is appended to, and a handful of [canvas, vocab] float32 arrays
    (logits, probabilities, self-conditioning, sampling)."""
    H = a.num_attention_heads
    worst = 0
    for sliding, kv, d in _layers(a):
        keys = (a.sliding_window - 1 if sliding else -(-positions // DEFAULT_BUCKET) * DEFAULT_BUCKET) + canvas
        worst = max(worst, 2 * H * canvas * keys * _F32 + 2 * kv * keys * d * itemsize)
    return worst + 6 * canvas * a.vocab_size * _F32


def estimate(a: ModelArgs, prompt_tokens: int, *, cached_tokens: int = 0, new_blocks: int = 1,
             chunk_size: int | None = DEFAULT_PREFILL_CHUNK, existing_kv_bytes: int = 0,
             dtype: mx.Dtype = mx.float32) -> MemoryEstimate:
    """What prefilling ``prompt_tokens`` after ``cached_tokens`` and generating ``new_blocks``
    canvases needs."""
    itemsize = dtype.size
    C = a.canvas_length
    total = cached_tokens + prompt_tokens + new_blocks * C
    chunk = prompt_tokens if chunk_size is None else min(chunk_size, prompt_tokens)
    return MemoryEstimate(
        kv_bytes=kv_cache_bytes(a, total, itemsize),
        prefill_working_bytes=prefill_working_bytes(a, cached_tokens + prompt_tokens, max(chunk, C), itemsize),
        step_working_bytes=step_working_bytes(a, total, C, itemsize),
        existing_kv_bytes=existing_kv_bytes)


def estimate_prefill(a: ModelArgs, prompt_tokens: int, chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
                     dtype: mx.Dtype = mx.float32) -> MemoryEstimate:
    """The prefill alone (no canvas): its cache and its working memory."""
    chunk = prompt_tokens if chunk_size is None else min(chunk_size, prompt_tokens)
    return MemoryEstimate(kv_cache_bytes(a, prompt_tokens, dtype.size),
                          prefill_working_bytes(a, prompt_tokens, chunk, dtype.size), 0)


def available_bytes() -> int:
    """Memory this process can still allocate: the accelerator's working set less what MLX
    holds, or the system's available memory (Linux MemAvailable) on the CPU."""
    try:
        info = mx.device_info()
        limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if limit and mx.default_device() == mx.gpu:
            return max(0, int(limit) - int(mx.get_active_memory()))
    except (AttributeError, RuntimeError):  # pragma: no cover - older MLX / no device info
        pass
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return min(avail, _cgroup_headroom())
    except (OSError, StopIteration, ValueError):  # pragma: no cover - not Linux
        pass
    try:  # pragma: no cover - macOS CPU
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - int(mx.get_active_memory())
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 1 << 62


def device_budget() -> tuple[int, str]:
    """(bytes, what they are) a model may use on this device, before anything is loaded: Metal's
    recommended working set on a Mac's GPU, the device's memory on a CUDA GPU (MLX reports no
    free figure there), available RAM on the CPU backend; less what MLX already holds."""
    import sys

    held = _mlx("get_active_memory")
    try:
        if mx.default_device() == mx.gpu:
            info = mx.device_info()
            if info.get("max_recommended_working_set_size"):
                label = "Metal's recommended working set" if sys.platform == "darwin" else "the GPU's working set"
                return max(0, int(info["max_recommended_working_set_size"]) - held), label
            if info.get("memory_size"):
                return max(0, int(info["memory_size"]) - held), "the GPU's memory"
    except (AttributeError, RuntimeError):  # pragma: no cover - older MLX / no device info
        pass
    return available_bytes(), "available RAM"


def _cgroup_headroom() -> int:
    """A container's memory limit less its usage (cgroup v2), or no bound."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        return 1 << 62 if limit == "max" else max(0, int(limit) - used)
    except (OSError, ValueError):
        return 1 << 62


def gb(n: int) -> str:
    """Bytes as people and --memory-limit read them: GB = 10^9 (as the README's tables), MB = 10^6."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def check_fits(est: MemoryEstimate, prompt_tokens: int, available: int | None = None) -> None:
    """Raise :class:`MemoryBudgetError` (one line: needed, available, what to do) when the
    estimate does not fit."""
    available = available_bytes() if available is None else available
    if est.needed_bytes > available:
        raise MemoryBudgetError(
            f"prompt: {prompt_tokens} tokens need about {gb(est.needed_bytes)} more memory (KV cache "
            f"{gb(est.kv_bytes)}, working {gb(est.working_bytes)}) but {gb(available)} is available; "
            "shorten the prompt, lower max_new_tokens, or free memory")


# --------------------------------------------------------------------------------------------
# what this process holds now, and its peak (generation's DoneEvent, the TUI, the server)

# Below this, MLX is not tracking the backend's allocations (the CPU backend allocates through
# the system): the process's resident memory is the better number.
MLX_TRACKED_MIN_BYTES = 64 << 20


def _mlx(name: str) -> int:
    fn = getattr(mx, name, None)
    return int(fn()) if fn is not None else 0  # older MLX: nothing tracked


def memory_bytes() -> int:
    """Memory in use now: MLX's active allocation, or the process's resident memory where
    MLX tracks none (CPU backend)."""
    active = _mlx("get_active_memory")
    return active if active > MLX_TRACKED_MIN_BYTES else current_rss_bytes()


def peak_memory_bytes() -> int:
    """Peak memory since :func:`reset_peak_memory`: MLX's peak allocation, or the process's peak
    resident memory where MLX tracks none (CPU backend; that peak is never reset)."""
    peak = _mlx("get_peak_memory")
    return peak if peak > MLX_TRACKED_MIN_BYTES else peak_rss_bytes()


def reset_peak_memory() -> None:
    """Start a new MLX peak (an answer's DoneEvent reports its own)."""
    if hasattr(mx, "reset_peak_memory"):
        mx.reset_peak_memory()
