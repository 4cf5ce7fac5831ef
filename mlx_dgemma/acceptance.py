"""The sampler's acceptance modes: which positions of a denoising step's canvas are kept, the
rest renoised, and when a block is done. Each mode is one :class:`Acceptance` subclass, chosen
once from the :class:`~mlx_dgemma.sampler.SamplerParams` (:func:`acceptance_of`) and called by
the compiled step (``sampler.sample_step``, and ``distributed.sharded_sample_step`` across ranks).

- :class:`EntropyBound` (the reference, the default): the lowest-entropy positions take their
  multinomial draw while the entropies' sum minus their max stays within ``entropy_bound``.
- :class:`ConfidenceThreshold` (``accept_probability``; mlx-vlm's default mode): a position whose
  top probability reaches the threshold is revealed with its argmax and kept for the rest of the
  block; the block is done once every position is revealed.

A new mode is its parameter in ``mlx_dgemma.params`` and a subclass here: the subclass names the
parameter that selects it (``param``), the sampler fields its graph bakes in (``traced``: the step's
trace key reads them) and whether it runs across ranks (``sharded``); the step, the sharded step,
the refusal under ``mlx.launch`` and the trace key follow.

The methods run inside ``mx.compile``d steps: plain MLX ops on their inputs, no host reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

import mlx.core as mx

from mlx_dgemma.errors import ParameterError

if TYPE_CHECKING:
    from mlx_dgemma.sampler import SamplerParams

Fixed = tuple[mx.array, mx.array]  # a canvas template's (mask [B, C] bool, tokens [B, C] int32)


class Acceptance:
    """One acceptance mode, built from the sampler's parameters (``params``: a SamplerParams or any
    object with its fields). Subclasses register themselves (:data:`MODES`, in definition order)."""

    param: ClassVar[str | None] = None  # the SamplerParams field that selects the mode (None: the default)
    traced: ClassVar[tuple[str, ...]] = ()  # the fields the mode's graph bakes in as constants
    sharded: ClassVar[bool] = False  # runs with the vocabulary split across ranks (mlx.launch)
    label: ClassVar[str] = ""  # its name in messages

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        MODES.append(cls)

    def __init__(self, params: Any):
        self.params = params

    def select(self, processed: mx.array, argmax: mx.array, entropy: mx.array, draw: Callable[[], mx.array],
               noise: mx.array, revealed: mx.array, fixed: Fixed | None) -> tuple[mx.array, mx.array, mx.array]:
        """(accepted [B, C] bool, next canvas [B, C], revealed [B, C]) of one step.

        ``processed``: the temperature-scaled logits [B, C, V] (this rank's vocabulary under
        ``mlx.launch``); ``argmax``, ``entropy`` [B, C] (a template's positions already held: its
        token, zero entropy); ``draw()``: the step's multinomial draw (built only when called);
        ``noise``: fresh uniform tokens; ``revealed``: the block's revealed canvas so far (-1 where
        hidden; a mode that keeps none passes it through); ``fixed``: a template's positions."""
        raise NotImplementedError

    def stop(self, stop: mx.array, accepted: mx.array) -> mx.array:
        """The block's stopping flag [B] after the stopping rule's ``stop``: by default that alone."""
        return stop


MODES: list[type[Acceptance]] = []


def accept_mask(entropy: mx.array, bound: float) -> mx.array:
    """EntropyBound: accept the lowest-entropy positions while sum - max <= bound."""
    order = mx.argsort(entropy, axis=-1)
    sorted_e = mx.take_along_axis(entropy, order, axis=-1)
    selected = (mx.cumsum(sorted_e, axis=-1) - sorted_e) <= bound
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(selected, inverse, axis=-1)


def confidence_reveal(processed: mx.array, argmax: mx.array, revealed: mx.array, threshold: float) -> mx.array:
    """Confidence-threshold acceptance (mlx-vlm's ``_diffusion_confidence_transfer_mask``):
    the new revealed canvas [B, C] (-1 where still hidden).

    A hidden position is revealed with its argmax when its top probability (of the
    temperature-scaled logits) is at least ``threshold``; when none qualifies, the most
    confident hidden position is revealed, so every step reveals at least one. Revealed
    positions keep their token for the rest of the block.
    """
    top = mx.exp(mx.max(processed, axis=-1) - mx.logsumexp(processed, axis=-1))  # p(argmax) [B, C]
    hidden = revealed < 0
    want = hidden & (top >= threshold)
    force = mx.any(hidden, axis=-1, keepdims=True) & ~mx.any(want, axis=-1, keepdims=True)
    best = mx.argmax(mx.where(hidden, top, -1.0), axis=-1, keepdims=True)
    forced = (mx.arange(top.shape[-1])[None, :] == best) & force
    return mx.where(want | forced, argmax, revealed)


class EntropyBound(Acceptance):
    """The reference: accepted positions take the multinomial draw, the rest fresh uniform tokens;
    nothing is kept between steps (``revealed`` passes through)."""

    traced = ("entropy_bound",)
    sharded = True
    label = "EntropyBound"

    def select(self, processed, argmax, entropy, draw, noise, revealed, fixed):
        drawn = draw()
        if fixed is not None:
            drawn = mx.where(fixed[0], fixed[1], drawn)
        accepted = accept_mask(entropy, self.params.entropy_bound)
        return accepted, mx.where(accepted, drawn, noise), revealed


class ConfidenceThreshold(Acceptance):
    """mlx-vlm's default (:func:`confidence_reveal`): revealed positions keep their token, the rest
    are renoised, ``accepted`` marks every revealed position; done once all are revealed."""

    param = "accept_probability"
    traced = ("accept_probability",)
    label = "confidence-threshold"

    def select(self, processed, argmax, entropy, draw, noise, revealed, fixed):
        if fixed is not None:
            revealed = mx.where(fixed[0], fixed[1], revealed)
        revealed = confidence_reveal(processed, argmax, revealed, self.params.accept_probability)
        accepted = revealed >= 0
        return accepted, mx.where(accepted, revealed, noise), revealed

    def stop(self, stop, accepted):
        return stop | mx.all(accepted, axis=-1)


def acceptance_of(params: SamplerParams, ranks: int = 1) -> Acceptance:
    """The mode ``params`` select: the one whose parameter is set, else the default (EntropyBound).
    ParameterError when two are set, or when the mode does not run across ``ranks`` > 1."""
    chosen = [m for m in MODES if m.param is not None and getattr(params, m.param, None) is not None]
    if len(chosen) > 1:
        names = " and ".join(m.param for m in chosen)  # type: ignore[misc]
        raise ParameterError(f"{names}: each selects an acceptance mode; give one of them",
                             param=chosen[-1].param)
    mode = chosen[0] if chosen else next(m for m in MODES if m.param is None)
    if ranks > 1 and not mode.sharded:
        raise ParameterError(f"{mode.param}: the {mode.label} mode runs in one process; leave it out under "
                             "mlx.launch (EntropyBound, the default, runs across ranks)")
    return mode(params)


def traced_fields() -> tuple[str, ...]:
    """Every mode's baked-in fields (the step's trace key reads them)."""
    return tuple(dict.fromkeys(f for m in MODES for f in m.traced))
