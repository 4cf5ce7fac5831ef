"""The denoising trace of an answer: every StepEvent, grouped by block, exportable as JSON
lines: a header record (what was asked of which model, with which settings), then one record
per step. Used by the TUI's replay/export and ``generate --trace``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ParameterError
from .events import StepEvent
from .paths import user_path


def check_trace_path(path: str | Path, name: str = "trace") -> Path:
    """A trace file can be written at ``path``: checked before generating, not after."""
    p = user_path(path)
    if p.is_dir():
        raise ParameterError(f"{name} {path}: is a directory; give a file name for the JSON lines, "
                             f"e.g. {p / 'trace.jsonl'}", param=name, rule="a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ParameterError(f"{name} {path}: directory {parent} does not exist; create it first "
                             "(mkdir -p)", param=name, rule="a file path")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ParameterError(f"{name} {path}: not writable; choose another place", param=name,
                             rule="a file path")
    return p


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

    def export_jsonl(self, path: str | Path, decode: Callable[[list[int]], str] | None = None) -> Path:
        """Write the header (if set), then one JSON object per step; written to a temporary file
        and renamed."""
        path = check_trace_path(path)
        tmp = path.with_name(f".{path.name[:200]}.partial-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                for rec in ([self.header] if self.header is not None else []) + self.records(decode):
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            tmp.replace(path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise ParameterError(f"trace {path}: cannot write ({e.strerror or e}); nothing was kept") from e
            raise
        return path
