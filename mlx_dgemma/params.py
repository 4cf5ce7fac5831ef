"""The generation parameters, each declared once: type, range, rule text, where its default
comes from, CLI flag, settings-screen label, server field and GGUF ``diffusion.eb_*`` key.

Everything that names a parameter is generated from :data:`PARAMS`: the range checks
(:data:`GENERATION_RULES`, :func:`check_generation_field`, below), the ``generate`` sampler
flags and the flag names errors quote (``cli.FLAGS``), the server's request fields
(``server.schemas.SAMPLER_FIELDS``), the settings screen's fields
(``tui.screens.settings.FIELDS``) and the GGUF key map the converter reads and checks
(:func:`gguf_keys`, in ``mlx_dgemma.convert.metadata``). Standard library only: the CLI builds
and checks its flags from here before anything heavy is imported.

The defaults themselves live in :class:`mlx_dgemma.schema.SamplerDefaults` (the reference's
values, written to generation_config.json); a parameter with ``model_default=False`` is the
run's own setting, off (None) unless given, and has no default to show.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ParameterError

# Temperatures divide logits softcapped to +-30: below 1e-3 (denormals included) the scaled
# logits leave float32's range and the step computes NaN; above 1e3 every draw is uniform.
_TEMPERATURE = (1e-3, 1e3)


@dataclass(frozen=True)
class Param:
    """One generation parameter."""

    name: str  # the field of SamplerParams and generation_config.json
    kind: type  # int or float
    low: int | float  # inclusive range
    high: int | float
    rule: str  # "must be <rule>" in every error about it
    flag: str  # the ``generate`` flag that sets it
    metavar: str
    help: str
    label: str | None = None  # on the settings screen (None: not shown there)
    screen_order: int = 0  # the settings screen's order (it groups what belongs together)
    no_default: str = "none"  # the settings placeholder where the model has no default
    server: bool = False  # an extra top-level field of the server's requests
    gguf_key: str | None = None  # the GGUF metadata key overriding its default, if any
    model_default: bool = True  # default from generation_config.json; False: None = off


PARAMS: tuple[Param, ...] = (  # in the order of ``generate --help``
    Param("max_new_tokens", int, 1, 10_000_000, "an integer in [1, 10000000]", "--max-tokens", "N",
          "new tokens at most (whole canvases are denoised; the answer is cut at N)", label="max new tokens", screen_order=8),
    Param("max_denoising_steps", int, 1, 10_000, "an integer in [1, 10000]", "--steps", "N",
          "max denoising steps per block", label="max steps per block", screen_order=1, server=True,
          gguf_key="diffusion.eb_max_steps"),
    Param("t_min", float, *_TEMPERATURE, "a temperature in [0.001, 1000]", "--t-min", "T",
          # the reference's schedule never reaches t_min: step k of N (counting down) runs at
          # t_min + (t_max - t_min) * k / N, the last one at t_min + (t_max - t_min) / N
          "floor of the linear temperature schedule (the last of N steps runs at t_min + (t_max - t_min)/N)",
          label="temperature floor", screen_order=3, server=True,
          gguf_key="diffusion.eb_t_min"),
    Param("t_max", float, *_TEMPERATURE, "a temperature in [0.001, 1000]", "--t-max", "T",
          "first-step temperature", label="first-step temperature", screen_order=2, server=True,
          gguf_key="diffusion.eb_t_max"),
    Param("entropy_bound", float, 1e-12, 1e9, "a number in [1e-12, 1e9]", "--entropy-bound", "X",
          "EntropyBound acceptance budget", label="entropy bound", screen_order=4, server=True,
          gguf_key="diffusion.eb_entropy_bound"),
    # the stopping rule keeps stability_threshold canvases on the device: bounded like the steps
    Param("stability_threshold", int, 0, 10_000, "an integer in [0, 10000]", "--stability-threshold", "N",
          "identical argmax canvases needed to stop", label="stability threshold", screen_order=5, server=True,
          gguf_key="diffusion.eb_stability_threshold"),
    Param("confidence_threshold", float, 1e-12, 1e9, "a number in [1e-12, 1e9]", "--confidence-threshold", "X",
          "mean entropy needed to stop", label="confidence threshold", screen_order=6, server=True,
          gguf_key="diffusion.eb_confidence_threshold"),
    # the vocabulary size caps it too, checked once the model is known (SamplerParams.check_model)
    Param("sc_top_k", int, 1, 2**31 - 1,
          "an integer >= 1 (leave it out for exact self-conditioning), at most the vocabulary size",
          "--sc-top-k", "K", "approximate self-conditioning with the top K tokens", server=True,
          model_default=False),
    Param("accept_probability", float, 0.0, 1.0, "a probability in [0, 1] (leave it out for EntropyBound)",
          "--accept-probability", "P",
          "confidence-threshold acceptance instead of EntropyBound: reveal a position once its top probability "
          "reaches P (mlx-vlm's default: 0.9); fewer steps, answers differ",
          label="accept probability", screen_order=7, no_default="off: EntropyBound", server=True,
          model_default=False),
    Param("seed", int, 0, 2**64 - 1, "an integer in [0, 2**64 - 1]", "--seed", "N", "make the run reproducible",
          label="seed (empty = random)", screen_order=9, no_default="random", server=True, model_default=False),
    # The answer guards (mlx_dgemma.guards): they act on what a block commits and returns, never
    # inside the step; where none fires the answer is the reference sampler's. 0 turns each off.
    Param("repetition_trim", int, 0, 10_000, "an integer in [0, 10000] (0 = off)", "--repetition-trim", "N",
          "end the answer where a token recurs at stride 1-2 N times in a row (TensorSharp's loop trim; "
          "0 = off)", label="loop trim (0 = off)", screen_order=10, server=True),
    Param("duplicate_drop", int, 0, 10_000, "an integer in [0, 10000] (0 = off)", "--duplicate-drop", "N",
          "drop a trailing exact copy of the answer of N characters or more (llama.cpp's; 0 = off)",
          label="duplicate drop (0 = off)", screen_order=11, server=True),
    Param("commit_entropy", float, 0.0, 1e9, "a number in [0, 1e9] (0 = off)", "--commit-entropy", "X",
          "re-roll once, else end the answer at, a block that ran out of steps with a last-step mean "
          "entropy above X (0 = off)", label="commit entropy (0 = off)", screen_order=12, server=True),
    Param("empty_rerolls", int, 0, 100, "an integer in [0, 100] (0 = off)", "--empty-rerolls", "N",
          "re-roll, up to N times with new keys, a first block that ends the turn before any text (0 = off)",
          label="empty re-rolls (0 = off)", screen_order=13, server=True),
)


@dataclass(frozen=True)
class Quality:
    """A named setting of the speed/quality dial (``--quality``, the server's ``quality`` field,
    the chat settings' quality row): values for the stopping and acceptance parameters
    (:data:`QUALITY_PARAMS`; None = the model's own default). Parameters a caller gives
    besides it win over it."""

    name: str
    settings: tuple[tuple[str, Any], ...]  # one value per QUALITY_PARAMS entry
    label: str  # in a few words, for the chat settings' choice
    help: str  # what it does and what it costs, measured (benchmarks/RESULTS.md)


# the parameters the dial sets (a preset sets every one of them: None = the model's default)
QUALITY_PARAMS: tuple[str, ...] = ("stability_threshold", "confidence_threshold", "accept_probability")
# measured on the fine-tuned demo and its K-quant copy: benchmarks/RESULTS.md, "The quality dial"
QUALITIES: tuple[Quality, ...] = (
    Quality("max", (("stability_threshold", None), ("confidence_threshold", None), ("accept_probability", None)),
            "reference sampler",
            "the model's own sampler (the reference: EntropyBound, stop once the canvas is stable and confident)"),
    Quality("balanced", (("stability_threshold", 0), ("confidence_threshold", 0.05), ("accept_probability", None)),
            "stop on entropy",
            "EntropyBound, stop once mean entropy < 0.05 without waiting for a stable canvas: about half "
            "the steps, most of the answer as max's"),
    Quality("fast", (("stability_threshold", None), ("confidence_threshold", None), ("accept_probability", 0.9)),
            "mlx-vlm's rule",
            "mlx-vlm's default: reveal a position once its top probability reaches 0.9: about half the "
            "steps, other answers"),
)
QUALITY_RULE = "one of " + ", ".join(q.name for q in QUALITIES)


def quality(name: str) -> Quality:
    """The dial's setting called ``name`` (ParameterError: not one of :data:`QUALITIES`)."""
    found = next((q for q in QUALITIES if q.name == name), None)
    if found is None:
        raise ParameterError(f"quality = {name!r}: must be {QUALITY_RULE}", param="quality", rule=QUALITY_RULE)
    return found


def quality_of(values: Mapping[str, Any]) -> str | None:
    """The dial's setting that ``values`` (sampler overrides; a missing name = the model's
    default) amount to, or None where they match none (set by hand)."""
    return next((q.name for q in QUALITIES if all(values.get(k) == v for k, v in q.settings)), None)


@dataclass(frozen=True)
class Order:
    """A rule between two parameters: ``low``'s value below ``high``'s."""

    low: str
    high: str
    why: str  # what the rule keeps true, said after it


# The rules between parameters: checked on the values in effect (the model's defaults filling in
# what a request leaves out), by SamplerParams and so for every front end alike.
ORDERS: tuple[Order, ...] = (
    Order("t_min", "t_max", "the temperature falls from the first step to the last"),
)


def get(name: str) -> Param | None:
    """The parameter called ``name`` (None: not a registry parameter)."""
    return next((p for p in PARAMS if p.name == name), None)


def gguf_keys() -> dict[str, Param]:
    """GGUF ``diffusion.eb_*`` key -> the parameter whose default it overrides."""
    return {p.gguf_key: p for p in PARAMS if p.gguf_key}


def flags() -> dict[str, str]:
    """Parameter name -> the ``generate`` flag that sets it (errors name what the user typed)."""
    return {p.name: p.flag for p in PARAMS}


def server_fields() -> tuple[str, ...]:
    """The parameters a server request may set as extra top-level fields."""
    return tuple(p.name for p in PARAMS if p.server)


def screen_params() -> list[Param]:
    """The parameters on the settings screen, in its order."""
    return sorted((p for p in PARAMS if p.label), key=lambda p: p.screen_order)


# ---------------------------------------------------------------------------------------------
# Checking a value against the rules


# the range rules: the registry's parameters, and the token ids the model's
# generation_config.json carries beside them
GENERATION_RULES: dict[str, tuple[str, Any, Any, str]] = {  # name: (kind, low, high, rule text)
    **{p.name: (p.kind.__name__, p.low, p.high, p.rule) for p in PARAMS},
    "pad_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
    "bos_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
    "mask_token_id": ("int", 0, 2**31 - 1, "a token id in [0, 2**31 - 1]"),
}


def is_int(v: Any) -> bool:
    """An integer (not a bool): the ``int`` parameters' type, and every count in a model's files."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite number (not a bool): the ``float`` parameters' type."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_generation_field(name: str, value: Any) -> None:
    """One generation parameter against its type and range (None allowed for the run's own
    settings, off by default: ``model_default=False`` in the registry)."""
    if name == "eos_token_id":
        ids = value if isinstance(value, (list, tuple)) else [value]
        if not ids or not all(is_int(i) and 0 <= i < 2**31 for i in ids):
            raise ParameterError(f"eos_token_id = {value!r}: must be a token id or a list of token ids",
                                 param=name, rule="a token id or a list of token ids")
        return
    param = get(name)
    rule = (param.kind.__name__, param.low, param.high, param.rule) if param else GENERATION_RULES.get(name)
    if rule is None or (value is None and param is not None and not param.model_default):
        return
    kind, low, high, text = rule
    ok = (is_int(value) if kind == "int" else is_number(value)) and low <= value <= high
    if not ok:
        raise ParameterError(f"{name} = {value!r}: must be {text}", param=name, rule=text)


def check_orders(values: Mapping[str, Any], given: Collection[str] = (),
                 defaults: Mapping[str, Any] | None = None) -> None:
    """The rules between parameters (:data:`ORDERS`) on ``values``, the values in effect. The
    error names the parameter that was given (``given``: the lower one when only it was, else
    the higher one), its rule the other's value; ``defaults`` (the model's own values, where
    known) are quoted after the rule's reason."""
    for order in ORDERS:
        low, high = values.get(order.low), values.get(order.high)
        if low is None or high is None or low < high:
            continue
        name = order.low if order.low in given and order.high not in given else order.high
        other = order.high if name == order.low else order.low
        param = get(other)
        rule = f"{'below' if name == order.low else 'above'} the {param.label if param and param.label else other} " \
               f"({values[other]})"
        note = order.why
        if defaults is not None and defaults.get(order.low) is not None and defaults.get(order.high) is not None:
            note += f" (this model's defaults are {defaults[order.low]} and {defaults[order.high]})"
        raise ParameterError(f"{name} = {values[name]!r}: must be {rule}; {note}", param=name, rule=rule, note=note)
