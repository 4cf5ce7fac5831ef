"""Messages from the engine thread to the UI (dataclasses; Textual's Message supports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message


@dataclass
class EngineStatus(Message):
    """Loading progress or a state change ("loading", "ready", "busy", or "failed": the model
    could not be loaded, ``detail`` says why)."""

    state: str
    detail: str = ""


@dataclass
class EngineEvent(Message):
    """A generation event (PrefillEvent, StepEvent, BlockEvent or DoneEvent) for the current answer."""

    event: Any
    answer_id: int


@dataclass
class EngineError(Message):
    """Loading or generation failed; shown in the app, never a crash."""

    message: str
    answer_id: int | None = None
