"""Sampler settings (validated with the same rules as the API)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from mlx_dgemma.errors import ParameterError
from mlx_dgemma.sampler import SamplerParams

FIELDS = [
    ("max_denoising_steps", "max steps per block", int),
    ("t_max", "first-step temperature", float),
    ("t_min", "final temperature", float),
    ("entropy_bound", "entropy bound", float),
    ("stability_threshold", "stability threshold", int),
    ("confidence_threshold", "confidence threshold", float),
    ("max_new_tokens", "max new tokens", int),
    ("seed", "seed (empty = random)", int),
]


class SettingsScreen(ModalScreen[dict | None]):
    BINDINGS = [("escape", "dismiss(None)", "Close")]

    def __init__(self, values: dict):
        super().__init__()
        self.values = values

    def compose(self) -> ComposeResult:
        with Vertical(id="settings"):
            yield Label("Sampler settings", id="settings-title")
            with Grid(id="settings-grid"):
                for name, label, _ in FIELDS:
                    yield Label(label)
                    v = self.values.get(name)
                    yield Input(value="" if v is None else str(v), id=f"set-{name}")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        out = {}
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            if not raw:
                continue
            try:
                out[name] = kind(raw)
            except ValueError:
                self.query_one("#settings-error", Label).update(f"{label}: {raw!r} is not a valid {kind.__name__}")
                return
        try:
            SamplerParams.from_config(self.values_without_fields(), **out)
        except ParameterError as e:
            self.query_one("#settings-error", Label).update(str(e))
            return
        self.dismiss(out)

    def values_without_fields(self) -> dict:
        names = {n for n, _, _ in FIELDS}
        return {k: v for k, v in self.values.items() if k not in names}
