"""The events of ``stream_generate`` / ``ChatSession.stream``: frozen plain-data dataclasses.

numpy only, no MLX: the trace, the TUI screens and test fakes read them without loading the
runtime. ``mlx_dgemma.generation`` produces them (import them from here, or the package).
Blocks and steps are numbered from 1, as users see them (the CLI, the chat app, the trace
and the server's ``diffusion`` events all show these numbers unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the events costs no numpy (the CLI's instant start)
    import numpy as np

__all__ = ["StepEvent", "BlockEvent", "DoneEvent", "PrefillEvent", "PrefillProgressEvent", "Event"]


@dataclass(frozen=True)
class StepEvent:
    """One denoising step of one block (arrays are read-only, one row per canvas position)."""

    block: int  # the block's number, from 1
    step: int  # 1-based step within the block
    max_steps: int
    canvas: np.ndarray  # the next canvas: accepted draws, renoised elsewhere [C] int32
    draft: np.ndarray  # argmax canvas of this step [C] int32
    accepted: np.ndarray  # [C] bool
    entropy: np.ndarray  # [C] float32, of the temperature-scaled logits
    mean_entropy: float
    temperature: float
    seconds: float
    stopped: bool  # the stopping rule fired at this step
    # 2, 3, ...: the block re-rolled by a guard (mlx_dgemma.guards: commit, empty answer); its
    # steps count from 1 again and replace the earlier attempt's
    attempt: int = 1


@dataclass(frozen=True)
class BlockEvent:
    """A committed block (the argmax canvas at the stopping step, padded after EOS; shorter where
    a guard cut it, and empty where the commit guard ended the answer before it)."""

    block: int  # the block's number, from 1 (the same as its StepEvents')
    tokens: tuple[int, ...]
    steps: int
    finished: bool  # the answer ends with this block: an EOS id was committed, or a guard ended it
    text: str  # the answer so far (thought channel removed)
    thinking: str  # the thought channel so far
    raw_text: str  # everything decoded, specials included
    # Only when asked (``logprobs=`` of stream_generate), else None: for each generated position of
    # the block (up to its EOS; the padding after it was never sampled), the log-probability of its
    # token and the ``logprobs`` most likely tokens under the distribution of the step that
    # committed the block (its stopping step: the logits divided by that step's temperature).
    logprobs: np.ndarray | None = None  # [n] float32
    top_ids: np.ndarray | None = None  # [n, k] int32, most likely first
    top_logprobs: np.ndarray | None = None  # [n, k] float32
    # the guard that ended the answer with this block (mlx_dgemma.guards.ENDINGS: "repetition",
    # "duplicate", "unconverged"), else None; the DoneEvent's finish_reason says the same
    end: str | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The summary of one answer."""

    text: str
    thinking: str
    tokens: tuple[int, ...]
    # "eos" | "length" | "cancelled", or the guard that ended the answer (mlx_dgemma.guards.ENDINGS:
    # "repetition", "duplicate", "unconverged")
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float
    prefill_tokens_per_second: float
    steps: int
    steps_per_block: tuple[int, ...]
    seconds_per_step: float
    tokens_per_forward: float
    generation_seconds: float
    peak_memory_bytes: int
    precision: str = ""  # the runtime precision that ran, e.g. "fast (bfloat16)"


@dataclass(frozen=True)
class PrefillEvent:
    """The prompt is encoded (after its last PrefillProgressEvent)."""

    tokens: int
    seconds: float


@dataclass(frozen=True)
class PrefillProgressEvent:
    """One prefill chunk done. The consumer may stop iterating here: the cache then holds
    the chunks done, and nothing else runs."""

    tokens_done: int
    tokens_total: int
    seconds: float  # since the prefill began


Event = StepEvent | BlockEvent | DoneEvent | PrefillEvent | PrefillProgressEvent
