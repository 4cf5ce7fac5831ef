"""The events of ``stream_generate`` / ``ChatSession.stream``: frozen plain-data dataclasses.

numpy only, no MLX: the trace, the TUI screens and test fakes read them without loading the
runtime. ``mlx_dgemma.generation`` produces them (import them from here, or the package).
Blocks and steps are numbered from 1, as users see them (the CLI, the chat app, the trace
and the server's ``diffusion`` events all show these numbers unchanged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing the events costs no numpy (the CLI's instant start)
    import numpy as np

__all__ = ["StepEvent", "BlockEvent", "DoneEvent", "PrefillEvent", "PrefillProgressEvent", "Event", "Stats"]


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

    @classmethod
    def cancelled(cls, prompt_tokens: int = 0, prefill_seconds: float = 0.0, peak_memory_bytes: int = 0,
                  precision: str = "") -> "DoneEvent":
        """An answer cancelled before its first step: during its prefill (``prompt_tokens``, the
        seconds it ran), or before it started (none). No text and no other figures."""
        return Stats().done("", "", (), "cancelled", peak_memory_bytes, precision, prompt_tokens=prompt_tokens,
                            prefill_seconds=prefill_seconds)


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


@dataclass
class Stats:
    """One answer's figures, folded from its events as they come (:meth:`add`): the DoneEvent's
    (:meth:`done`, which the core yields), the server's ``timings`` and the chat app's status line
    read them here, so each figure is computed once, the same way everywhere.

    ``pad_id``: the padding token, not counted among the answer's tokens (None: every token counts).
    """

    pad_id: int | None = None
    prompt_tokens: int = 0  # encoded by the prefill (its PrefillEvent)
    prefill_seconds: float = 0.0
    steps: int = 0  # decoder passes: every StepEvent, a re-rolled or cancelled block's included
    step_seconds: float = 0.0
    # the steps of each block the answer holds: one a guard re-rolled counts its last attempt; one the
    # commit guard dropped (``end == "unconverged"``: no tokens) is not one of its blocks
    steps_per_block: list[int] = field(default_factory=list)
    answer_tokens: int = 0  # committed tokens, padding left out
    started: float | None = None  # perf_counter() when the prompt was encoded: generation begins

    def add(self, ev: Any) -> None:
        """Fold one event in (a DoneEvent, or anything else, changes nothing)."""
        if isinstance(ev, StepEvent):
            self.steps += 1
            self.step_seconds += ev.seconds
        elif isinstance(ev, BlockEvent):
            if ev.end != "unconverged":
                self.steps_per_block.append(ev.steps)
            self.answer_tokens += sum(1 for t in ev.tokens if t != self.pad_id)
        elif isinstance(ev, PrefillEvent):
            self.prompt_tokens, self.prefill_seconds = ev.tokens, ev.seconds
            self.started = time.perf_counter()

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.step_seconds / self.steps if self.steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Answer tokens per decoder pass (0.0 before any step)."""
        return self.answer_tokens / self.steps if self.steps else 0.0

    @property
    def generation_seconds(self) -> float:
        """Seconds since the prompt was encoded (0.0 before)."""
        return time.perf_counter() - self.started if self.started is not None else 0.0

    def done(self, text: str, thinking: str, tokens: tuple[int, ...], finish_reason: str, peak_memory_bytes: int,
             precision: str = "", **figures: Any) -> DoneEvent:
        """The answer's DoneEvent: its text, tokens and ending as given, every figure the DoneEvent
        declares taken from here by its name (``figures``: any given instead)."""
        given = {"text": text, "thinking": thinking, "tokens": tuple(tokens), "finish_reason": finish_reason,
                 "peak_memory_bytes": peak_memory_bytes, "precision": precision, **figures}
        mine = {f.name: getattr(self, f.name) for f in fields(DoneEvent) if f.name not in given}
        return DoneEvent(**given, **{k: tuple(v) if isinstance(v, list) else v for k, v in mine.items()})
