"""Memory estimates for a prompt, checked before any work is done.

The KV cache is exact (its shapes are known: ``window - 1`` ring slots on sliding layers,
every position rounded up to the bucket on global layers). The working memory is an upper
estimate of the largest transient buffers: one prefill chunk's activations and attention
scores (bounded by ``schema.ATTENTION_SCORES_BUDGET``), or one denoising step's attention
over the whole cache plus its [canvas, vocab] logits, whichever is larger.

The estimates are arithmetic on :class:`~mlx_dgemma.schema.ModelArgs` and import no MLX (the
converter plans with them); what the device offers and what MLX holds import it when asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_dgemma.errors import MemoryBudgetError
from mlx_dgemma.rss import current_rss_bytes, peak_rss_bytes  # noqa: F401 (re-exported)
from mlx_dgemma.schema import ATTENTION_SCORES_BUDGET, DEFAULT_BUCKET, DEFAULT_PREFILL_CHUNK, ModelArgs

if TYPE_CHECKING:
    import mlx.core as mx

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


def _itemsize(dtype: mx.Dtype | int | None) -> int:
    """Bytes per element of an MLX dtype, or an item size given as is (default float32's)."""
    return _F32 if dtype is None else dtype if isinstance(dtype, int) else dtype.size


def estimate(a: ModelArgs, prompt_tokens: int, *, cached_tokens: int = 0, new_blocks: int = 1,
             chunk_size: int | None = DEFAULT_PREFILL_CHUNK, existing_kv_bytes: int = 0,
             dtype: mx.Dtype | int | None = None) -> MemoryEstimate:
    """What prefilling ``prompt_tokens`` after ``cached_tokens`` and generating ``new_blocks``
    canvases needs, with activations of ``dtype`` (an MLX dtype or its item size; float32)."""
    itemsize = _itemsize(dtype)
    C = a.canvas_length
    total = cached_tokens + prompt_tokens + new_blocks * C
    chunk = prompt_tokens if chunk_size is None else min(chunk_size, prompt_tokens)
    return MemoryEstimate(
        kv_bytes=kv_cache_bytes(a, total, itemsize),
        prefill_working_bytes=prefill_working_bytes(a, cached_tokens + prompt_tokens, max(chunk, C), itemsize),
        step_working_bytes=step_working_bytes(a, total, C, itemsize),
        existing_kv_bytes=existing_kv_bytes)


def estimate_prefill(a: ModelArgs, prompt_tokens: int, chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
                     dtype: mx.Dtype | int | None = None) -> MemoryEstimate:
    """The prefill alone (no canvas): its cache and its working memory."""
    chunk = prompt_tokens if chunk_size is None else min(chunk_size, prompt_tokens)
    itemsize = _itemsize(dtype)
    return MemoryEstimate(kv_cache_bytes(a, prompt_tokens, itemsize),
                          prefill_working_bytes(a, prompt_tokens, chunk, itemsize), 0)


def available_bytes(limit: int | None = None, held: int = 0) -> int:
    """Memory a prompt may still use. With ``limit`` (``--memory-limit``: the one budget, for
    the plan and for every prompt) that limit less what this process holds (MLX's active
    memory, and at least ``held``: the weights and the KV cache already allocated); else what
    the device still offers (:func:`device_budget`)."""
    if limit is None:
        return device_budget()[0]
    return max(0, limit - max(held, _mlx("get_active_memory")))


def device_budget() -> tuple[int, str]:
    """(bytes, what they are) a model may use on this device, less what MLX already holds:
    Metal's recommended working set on a Mac's GPU; on a CUDA GPU its memory (what MLX's
    allocator allows, 95 % of it, bounded by what the GPU has free now); available RAM on the
    CPU backend."""
    import sys

    import mlx.core as mx

    held = _mlx("get_active_memory")
    try:
        if mx.default_device() == mx.gpu:
            info = mx.device_info()
            if info.get("max_recommended_working_set_size"):
                label = "Metal's recommended working set" if sys.platform == "darwin" else "the GPU's working set"
                return max(0, int(info["max_recommended_working_set_size"]) - held), label
            total = info.get("total_memory") or info.get("memory_size")
            if total:  # CUDA (mlx/backend/cuda/device_info.cpp): the GPU's memory, not the host's RAM
                limit = int(0.95 * int(total)) - held  # MLX's CUDA allocator stops at 95 % (allocator.cpp)
                if info.get("free_memory") is not None:  # others' use too; this process's is in it already
                    limit = min(limit, int(info["free_memory"]))
                return max(0, limit), "the GPU's memory"
    except (AttributeError, RuntimeError):  # pragma: no cover - older MLX / no device info
        pass
    avail = system_available_bytes()
    if avail is None:  # pragma: no cover - macOS CPU
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - held
        except (ValueError, OSError, AttributeError):
            avail = 1 << 62
    return max(0, avail), "available RAM"


def device_ram_bytes() -> int:
    """The machine's RAM as MLX's device reports it (Metal: ``hw.memsize``), or 0."""
    import mlx.core as mx

    try:
        return int(mx.device_info().get("memory_size") or 0)
    except (AttributeError, RuntimeError):  # pragma: no cover - older MLX
        return 0


def system_available_bytes() -> int | None:
    """Available RAM from the system alone, no MLX: Linux's MemAvailable bounded by a
    container's limit; on macOS ``vm_stat``'s free, inactive and speculative pages (what macOS
    hands out without paging); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return min(avail, _cgroup_headroom())
    except (OSError, StopIteration, ValueError):  # not Linux
        pass
    import sys

    return _vm_stat_available() if sys.platform == "darwin" else None


def _vm_stat_available(text: str | None = None) -> int | None:
    """macOS: (free + inactive + speculative) pages times the page size, from ``vm_stat``'s
    output (``text``, else run it); None if it cannot be read."""
    import re
    import subprocess

    if text is None:
        try:
            text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    size = re.search(r"page size of (\d+) bytes", text)
    pages = dict(re.findall(r"^Pages (free|inactive|speculative):\s+(\d+)\.", text, re.M))
    if size is None or not pages:
        return None
    return int(size.group(1)) * sum(int(n) for n in pages.values())


def _cgroup_headroom() -> int:
    """A container's memory limit less its usage (cgroup v2), or no bound."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        return 1 << 62 if limit == "max" else max(0, int(limit) - used)
    except (OSError, ValueError):
        return 1 << 62


def gb(n: int) -> str:
    """Bytes as people and --memory-limit read them: GB = 10^9 (as the README's tables), MB = 10^6
    below 1 GB (104 and 103 MB were both "0.10 GB": a refusal read "needs 0.10 GB but 0.10 GB is
    available")."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_fits(est: MemoryEstimate, prompt_tokens: int, available: int | None = None,
               budget: str | None = None) -> None:
    """Raise :class:`MemoryBudgetError` (one line: needed, available, what to do) when the
    estimate does not fit; ``budget`` names where ``available`` comes from ("--memory-limit")."""
    available = available_bytes() if available is None else available
    if est.needed_bytes > available:
        where = f" ({budget})" if budget else ""
        more = f"or raise {budget}" if budget == "--memory-limit" else "or free memory"
        raise MemoryBudgetError(
            f"prompt: {prompt_tokens} tokens need about {gb(est.needed_bytes)} more memory (KV cache "
            f"{gb(est.kv_bytes)}, working {gb(est.working_bytes)}) but {gb(available)} is available{where}; "
            f"shorten the prompt, lower max_new_tokens, {more}")


# --------------------------------------------------------------------------------------------
# what this process holds now, and its peak (generation's DoneEvent, the TUI, the server)

# Below this, MLX is not tracking the backend's allocations (the CPU backend allocates through
# the system): the process's resident memory is the better number.
MLX_TRACKED_MIN_BYTES = 64 << 20


def _mlx(name: str) -> int:
    import mlx.core as mx

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
    import mlx.core as mx

    if hasattr(mx, "reset_peak_memory"):
        mx.reset_peak_memory()
