"""A scripted backend for the TUI (a ``mlx_dgemma.tui.engine.Backend``): deterministic events, no MLX."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mlx_dgemma.events import BlockEvent, DoneEvent, Event, PrefillEvent, StepEvent
from mlx_dgemma.host import ModelInfo
from mlx_dgemma.request import GenerationRequest

WORDS = ["The", " sky", " is", " blue", " because", " air", " scatters", " short", " waves", ".",
         " Light", " from", " the", " sun", " bends", "!"]


class ScriptedBackend:
    label = "scripted test model"
    is_demo = False
    canvas_length = 16
    precision_label = "fast (bfloat16)"
    generation_config = {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
                         "stability_threshold": 1, "confidence_threshold": 0.005, "max_new_tokens": 32}

    def __init__(self, steps: int = 6, blocks: int = 2, delay: float = 0.0, think: bool = False,
                 system: str | None = None, sampler: dict | None = None):
        self.steps, self.blocks, self.delay = steps, blocks, delay
        self.think, self.system = think, system
        self.sampler = dict(sampler or {})  # the sampler overrides to start with (chat --quality)
        self.systems: list[str | None] = []  # the system prompt of each new chat
        self.loaded = self.resets = 0
        self.closed = False
        self.prompts: list[tuple[str, dict]] = []
        self.thinks: list[bool] = []  # the thought channel of each answer
        self.produced = 0  # steps yielded so far (engine thread)

    @property
    def info(self) -> ModelInfo:
        """The scripted model's facts, from its attributes (known from the start)."""
        return ModelInfo(name=self.label, precision=self.precision_label, demo="trained" if self.is_demo else None,
                         canvas_length=self.canvas_length, context_length=4096, vocab_size=len(WORDS),
                         generation_config=self.generation_config)

    def load(self, progress: Callable[[str], None]) -> None:
        progress("scripted")
        self.loaded += 1

    def reset(self, system: str | None = None) -> None:
        self.resets += 1
        self.systems.append(system)

    def close(self) -> None:
        self.closed = True

    def piece(self, token_id: int) -> str:
        return WORDS[token_id % len(WORDS)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(t) for t in ids)

    def sc_top_k(self, params) -> int | None:
        return params.sc_top_k  # a scripted model has no precision of its own

    def memory_bytes(self) -> int:
        return 123_000_000

    def stream(self, prompt: str, cancel: Callable[[], bool], think: bool = False,
               request: GenerationRequest | None = None) -> Iterator[Event]:
        self.prompts.append((prompt, request.params if request is not None else {}))
        self.thinks.append(think)
        C, N = self.canvas_length, self.steps
        yield PrefillEvent(tokens=20, seconds=0.5)
        out, done_steps = [], 0
        for b in range(self.blocks):
            target = (np.arange(C) + b * C) % len(WORDS)
            for s in range(1, N + 1):
                if self.delay:
                    time.sleep(self.delay)
                k = min(C, round(C * s / N))
                accepted = np.zeros(C, bool)
                accepted[:k] = True
                entropy = np.linspace(3.0, 0.01, C).astype(np.float32) / s
                draft = target.astype(np.int32)
                canvas = np.where(accepted, target, (target + 3) % len(WORDS)).astype(np.int32)
                for a in (accepted, entropy, draft, canvas):
                    a.setflags(write=False)
                done_steps += 1
                self.produced += 1
                yield StepEvent(block=b + 1, step=s, max_steps=48, canvas=canvas, draft=draft, accepted=accepted,
                                entropy=entropy, mean_entropy=float(entropy.mean()),
                                temperature=0.4 + 0.4 * (48 - s + 1) / 48, seconds=0.25, stopped=s == N)
                if cancel():
                    yield DoneEvent(text=self.decode(out), thinking="", tokens=tuple(out), finish_reason="cancelled",
                                    prompt_tokens=20, prefill_seconds=0.5, prefill_tokens_per_second=40.0,
                                    steps=done_steps, steps_per_block=(), seconds_per_step=0.25,
                                    tokens_per_forward=0.0, generation_seconds=1.0, peak_memory_bytes=1,
                                    precision=self.precision_label)
                    return
            out += target.tolist()
            text = self.decode(out)
            yield BlockEvent(block=b + 1, tokens=tuple(target.tolist()), steps=N, finished=b == self.blocks - 1,
                             text=text, thinking="Thinking about light.", raw_text=text)
        yield DoneEvent(text=self.decode(out), thinking="Thinking about light.", tokens=tuple(out), finish_reason="eos",
                        prompt_tokens=20, prefill_seconds=0.5, prefill_tokens_per_second=40.0, steps=done_steps,
                        steps_per_block=(N,) * self.blocks, seconds_per_step=0.25,
                        tokens_per_forward=len(out) / done_steps, generation_seconds=3.0,
                        peak_memory_bytes=200_000_000, precision=self.precision_label)


class GatedLoad(ScriptedBackend):
    """A load that waits for ``release`` (set it in a ``finally``: a test that fails must not
    leave the engine thread waiting): first it reports ``line`` (if any), then, once released,
    it finishes (``finish``) or returns without loading (a load that was given up)."""

    def __init__(self, line: str | None = None, finish: bool = True, wait_s: float = 30, **kw: Any):
        super().__init__(**kw)
        self.release = threading.Event()
        self.line, self.finish, self.wait_s = line, finish, wait_s

    def load(self, progress: Callable[[str], None]) -> None:
        if self.line is not None:
            progress(self.line)
        self.release.wait(self.wait_s)
        if self.finish:
            super().load(progress)
