"""Messages from the engine thread to the UI (dataclasses; Textual's Message supports them).
The chat screen handles each of them, every status included (tests/test_tui_engine.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from textual.message import Message

from mlx_dgemma.events import Event

State = Literal["loading", "ready", "busy", "failed"]
STATES: tuple[str, ...] = get_args(State)


@dataclass
class EngineStatus(Message):
    """A state change: "loading" (``detail``: what is being loaded), "ready" (``detail``: the
    model, once loaded; empty after an answer), "busy" (an answer has started) or "failed" (the
    model could not be loaded; ``detail`` says why)."""

    state: State
    detail: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state not in STATES:  # a state no screen handles would be dropped silently
            raise ValueError(f"EngineStatus state {self.state!r}: expected one of {', '.join(STATES)}")


@dataclass
class EngineEvent(Message):
    """A generation event (PrefillEvent, StepEvent, BlockEvent or DoneEvent) for the current answer."""

    event: Event
    answer_id: int


@dataclass
class EngineError(Message):
    """Generation (or a reset) failed; shown in the app, never a crash."""

    message: str
    answer_id: int | None = None
