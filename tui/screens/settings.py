"""Sampler settings (checked as the core's request: the registry's rules, as every front end)
and the chat's own: the thought channel and the system prompt. An empty sampler field means the
model's own default (shown as the placeholder); errors name the field by its label."""

from __future__ import annotations

from dataclasses import dataclass, field

from textual import on
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select

from mlx_dgemma.tokenizer import check_text

from mlx_dgemma import params
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.request import GenerationRequest

# (name, label, type): the registry's parameters that have a label (mlx_dgemma.params)
FIELDS = [(p.name, p.label, p.kind) for p in params.screen_params()]
LABELS = {name: label for name, label, _ in FIELDS}
# what an empty field means where the model has no default (the placeholder)
NO_DEFAULT = {p.name: p.no_default for p in params.screen_params()}
KIND_NAMES = {int: "a whole number", float: "a number"}


@dataclass(frozen=True)
class Settings:
    """What the dialog returns: the sampler overrides (only the fields that differ from the
    model's defaults), the thought channel, and the system prompt (None: none)."""

    sampler: dict = field(default_factory=dict)
    think: bool = False
    system: str | None = None


class SettingsScreen(ModalScreen[Settings | None]):
    """Returns the :class:`Settings` chosen, or None (cancelled)."""

    BINDINGS = [("escape", "dismiss(None)", "Close")]

    def __init__(self, values: dict, defaults: dict | None = None, think: bool = False, system: str | None = None):
        super().__init__()
        self.values = values  # what the fields show: the model's defaults with the current overrides
        self.defaults = dict(values if defaults is None else defaults)  # the model's own
        self.think, self.system = think, system

    def compose(self) -> ComposeResult:
        with Vertical(id="settings"):
            yield Label("Settings (an empty sampler field = the model's default)", id="settings-title")
            with Grid(id="settings-grid"):
                # the speed/quality dial: a setting fills the fields it sets (they stay editable)
                yield Label("quality")
                overrides = {k: v for k, v in self.values.items() if v != self.defaults.get(k)}
                chosen = params.quality_of(overrides)
                yield Select([(f"{q.name}: {q.label}", q.name) for q in params.QUALITIES], id="set-quality",
                             prompt="custom (the fields below)", value=chosen if chosen else Select.BLANK)
                for name, label, _ in FIELDS:
                    yield Label(label)
                    v = self.values.get(name)
                    default = self.defaults.get(name)
                    yield Input(value="" if v is None else str(v), id=f"set-{name}",
                                placeholder=NO_DEFAULT.get(name, "none") if default is None else f"default {default}")
                yield Label("thought channel")
                yield Checkbox("think before answering", self.think, id="set-think")
                yield Label("system prompt (new chat)")
                yield Input(value=self.system or "", id="set-system", placeholder="none")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Select.Changed, "#set-quality")
    def _quality(self, event: Select.Changed) -> None:
        """A dial setting fills its fields: its value, or the model's default where it has none."""
        if event.value is Select.BLANK:
            return
        for name, value in params.quality(str(event.value)).settings:
            value = self.defaults.get(name) if value is None else value
            self.query_one(f"#set-{name}", Input).value = "" if value is None else str(value)

    def _error(self, text: str) -> None:
        self.query_one("#settings-error", Label).update(text)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        """Enter in any field saves, as in any form (Tab still moves between fields)."""
        self._save()

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        chosen, typed, errors = {}, {}, []
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            if not raw:
                continue  # cleared: the model's default
            try:
                value = kind(raw)
            except ValueError:
                errors.append(f"{label}: {raw!r} is not {KIND_NAMES[kind]}")
                continue
            chosen[name], typed[name] = value, raw
        # the fields that differ from the model's defaults, as the core's request: each field's own
        # range first (the registry's rule, e.g. a temperature in [0.001, 1000]), every field's
        # error at once (one a save was a round trip per mistake), then the rules between fields on
        # the values in effect: 5000 is out of range, not "above the temperature floor"
        overrides = {k: v for k, v in chosen.items() if v != self.defaults.get(k)}
        for name, value in overrides.items():
            try:
                GenerationRequest.of({name: value})
            except ParameterError as e:
                errors.append(e.restated(LABELS.get(e.param, str(e.param)), typed.get(e.param)))
        if not errors:
            try:
                GenerationRequest.of(overrides).resolve(self.defaults)
            except ParameterError as e:
                errors.append(e.restated(LABELS.get(e.param, str(e.param)), typed.get(e.param)))
        if errors:
            self._error("\n".join(errors))
            return
        system = self.query_one("#set-system", Input).value.strip() or None
        if system is not None:
            try:
                check_text(system, "system prompt")
            except ParameterError as e:
                self._error(str(e))
                return
        self.dismiss(Settings({name: overrides[name] for name in LABELS if name in overrides},
                              self.query_one("#set-think", Checkbox).value, system))


def describe(settings: Settings) -> str:
    """A one-line summary of the settings for the notification."""
    overrides = settings.sampler
    chat = f" Thought channel {'on' if settings.think else 'off'}."
    if not overrides:
        return "Sampler settings: the model's defaults." + chat
    dial = params.quality_of(overrides)
    named = f" (quality {dial})" if dial not in (None, "max") else ""
    return "Sampler settings" + named + ": " + ", ".join(f"{LABELS.get(k, k)} {v}" for k, v in overrides.items()) \
        + "; the rest are the model's defaults." + chat
