"""The denoising trace of an answer: every StepEvent, grouped by block, exportable as JSON
lines: a header record (what was asked of which model, with which settings), then one record
per step. Used by the TUI's replay/export and ``generate --trace``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .events import StepEvent
from .paths import OutputFile, check_output_file, open_output


TRACE_FORMAT = 1  # the header's "format": raised when a record changes meaning


def trace_header(prompt: str, settings: dict[str, Any], model: str, precision: str, *,
                 seed: int | None = None, **extra: Any) -> dict[str, Any]:
    """The first record of an exported trace: enough to know what produced the steps after it.

    ``settings``: the sampler settings in effect (every field, the model's defaults included);
    ``seed``: the seed given, or None when none was (a random seed: the run cannot be repeated);
    ``extra``: other facts worth keeping (the chat app adds ``thinking``, ``system`` and ``turn``)."""
    from . import __version__

    return {"record": "header", "format": TRACE_FORMAT, "mlx_dgemma_version": __version__, "model": model,
            "precision": precision, "prompt": prompt, "seed": seed,
            "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}, **extra}


def settings_in_effect(params: Any, sc_top_k: int | None) -> dict[str, Any]:
    """The sampler settings a header records: every field of ``params`` (a
    :class:`mlx_dgemma.sampler.SamplerParams`), with ``sc_top_k`` as the step runs it
    (``Runtime.sc_top_k``: the request's, else the runtime precision's, fast's top-64; None =
    the whole vocabulary)."""
    from dataclasses import asdict

    return {**asdict(params), "sc_top_k": sc_top_k}


@dataclass
class Trace:
    blocks: list[list[StepEvent]] = field(default_factory=list)
    header: dict[str, Any] | None = None  # written first by export_jsonl (see trace_header)

    def add(self, ev: StepEvent) -> None:
        """Record a step; ``blocks[i]`` holds block number ``i + 1`` (events count from 1). A
        block the commit guard re-rolls (``attempt`` 2) replaces its first attempt's steps: the
        trace holds the steps of the canvas that counts."""
        while len(self.blocks) < ev.block:
            self.blocks.append([])
        steps = self.blocks[ev.block - 1]
        if steps and steps[-1].attempt != ev.attempt:
            steps.clear()
        steps.append(ev)

    def clear(self) -> None:
        self.blocks.clear()

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(block index, step index) of every recorded step, in order, both from 0 (list positions)."""
        return [(b, i) for b, steps in enumerate(self.blocks) for i in range(len(steps))]

    def get(self, block: int, index: int) -> StepEvent:
        return self.blocks[block][index]

    def records(self, decode: Callable[[list[int]], str] | None = None) -> list[dict]:
        """One record per step. ``block`` and ``step`` count from 1, as the events do."""
        out = []
        for steps in self.blocks:
            for ev in steps:
                rec = {"block": ev.block, "step": ev.step, "max_steps": ev.max_steps,
                       "temperature": ev.temperature, "mean_entropy": ev.mean_entropy,
                       "accepted_count": int(ev.accepted.sum()), "seconds": ev.seconds, "stopped": ev.stopped,
                       "canvas": ev.canvas.tolist(), "draft": ev.draft.tolist(),
                       "accepted": ev.accepted.astype(int).tolist(),
                       "entropy": [round(float(x), 6) for x in ev.entropy]}
                if decode is not None:
                    rec["draft_text"] = decode(ev.draft.tolist())
                out.append(rec)
        return out

    def export_jsonl(self, path: str | os.PathLike | OutputFile,
                     decode: Callable[[list[int]], str] | None = None,
                     inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
        """Write the header (if set), then one JSON object per step, to ``path`` (checked as
        :func:`mlx_dgemma.paths.check_output_file` checks any output, against ``inputs``, unless
        it already was): a regular file is replaced whole, a FIFO or device written in place."""
        out = path if isinstance(path, OutputFile) else check_output_file(path, "trace", inputs, "trace.jsonl")
        with open_output(out) as f:
            for rec in ([self.header] if self.header is not None else []) + self.records(decode):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        return out.target
