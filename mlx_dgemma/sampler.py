"""The reference sampler, on the device: linear temperature schedule, EntropyBound acceptance
with renoising, StableAndConfident stopping (``generation_diffusion_gemma.py``).

Opt-in instead of EntropyBound (``accept_probability``): mlx-vlm's default confidence-threshold
acceptance, where a position whose top probability reaches the threshold is revealed with its
argmax and kept for the rest of the block, and the block stops once every position is revealed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import mlx.core as mx

from .errors import ParameterError
from .schema import SamplerDefaults
from .params import check_generation_field as check_field


@dataclass(frozen=True)
class SamplerParams(SamplerDefaults):
    """Generation parameters (generation_config.json, overridable per call): the reference
    defaults (:class:`mlx_dgemma.schema.SamplerDefaults`) plus the run's own settings."""

    seed: int | None = None
    sc_top_k: int | None = None  # sparse self-conditioning (None = exact)
    # confidence-threshold acceptance (mlx-vlm's default, 0.9 there); None = EntropyBound (the reference)
    accept_probability: float | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None, **overrides: Any) -> "SamplerParams":
        names = {f.name for f in fields(cls)}
        base = {k: v for k, v in (cfg or {}).items() if k in names}
        unknown = set(overrides) - names
        if unknown:
            raise ParameterError(f"unknown generation parameter(s) {sorted(unknown)}; known: {sorted(names)}")
        base.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(base.get("eos_token_id"), int):
            base["eos_token_id"] = (base["eos_token_id"],)
        if isinstance(base.get("eos_token_id"), list):
            base["eos_token_id"] = tuple(base["eos_token_id"])
        p = cls(**base)
        p.validate()
        return p

    def with_overrides(self, **kw: Any) -> "SamplerParams":
        p = replace(self, **{k: v for k, v in kw.items() if v is not None})
        p.validate(defaults=self)
        return p

    def validate(self, defaults: "SamplerParams | None" = None) -> None:
        """Check every field (types, finite ranges) and the schedule; ParameterError names the field.
        ``defaults`` (the values before a caller's overrides) are quoted in the schedule's error."""
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        if not self.t_max > self.t_min:
            # the model's own defaults, not the reference's (the demo's are 0.05 and 0.25)
            quoted = f" (this model's defaults are {defaults.t_min} and {defaults.t_max})" if defaults else ""
            raise ParameterError(f"t_min = {self.t_min!r}, t_max = {self.t_max!r}: the schedule needs "
                                 f"0 < t_min < t_max{quoted}", param="t_max", rule="greater than t_min")

    def check_model(self, vocab_size: int) -> None:
        """Checks that need the model: ``sc_top_k`` at most the vocabulary."""
        if self.sc_top_k is not None and self.sc_top_k > vocab_size:
            raise ParameterError(f"sc_top_k = {self.sc_top_k}: must be at most the vocabulary size "
                                 f"({vocab_size})", param="sc_top_k", rule=f"an integer in [1, {vocab_size}]")


def temperature(steps_left: int, p: SamplerParams) -> float:
    """Linear schedule; ``steps_left`` counts down N..1, so step 1 of N gets t_max."""
    return p.t_min + (p.t_max - p.t_min) * (steps_left / p.max_denoising_steps)


def token_entropy(logits: mx.array) -> mx.array:
    """Entropy of softmax(logits) per position (as torch's Categorical(logits=...).entropy())."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(logp)
    return -mx.sum(mx.where(p > 0, p * logp, 0.0), axis=-1)


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


def fixed_logits(processed: mx.array, mask: mx.array, tokens: mx.array, lo: int = 0) -> mx.array:
    """``processed`` (logits [B, C, V'], V' ids from ``lo``) with each fixed position (``mask``)
    one-hot on its token: the next step's self-conditioning reads the given token there, as
    the model would read its own certain prediction. -1e4, not -inf: finite in float16 too."""
    ids = mx.arange(lo, lo + processed.shape[-1])
    hot = mx.where(ids == tokens[..., None], 0.0, -1e4).astype(processed.dtype)
    return mx.where(mask[..., None], hot, processed)


def sample_step(raw_logits: mx.array, temp: float | mx.array, bound: float, vocab_size: int,
                key: mx.array, accept_probability: float | None = None,
                revealed: mx.array | None = None,
                fixed: tuple[mx.array, mx.array] | None = None) -> dict[str, mx.array]:
    """One step of the sampler on the decoder's logits [B, C, V].

    Returns processed logits (the next self-conditioning input), the argmax canvas, the
    per-position entropy, the accepted mask, the next canvas and the revealed canvas.
    EntropyBound (``accept_probability`` None): accepted positions take the multinomial
    draw, the rest fresh uniform tokens; ``revealed`` passes through. Confidence threshold:
    see :func:`confidence_reveal`; revealed positions keep their token, the rest are
    renoised, and ``accepted`` marks every revealed position.

    ``fixed`` (mask [B, C], tokens [B, C]; a canvas template, :mod:`mlx_dgemma.canvas`): those
    positions hold their token in the canvas and the argmax, are accepted with zero entropy
    (they use none of the EntropyBound budget and count as confident for stopping) and are
    one-hot in the processed logits. None (the default) adds nothing to the graph.
    """
    k_draw, k_noise = mx.random.split(key)
    processed = raw_logits / temp
    argmax = mx.argmax(processed, axis=-1).astype(mx.int32)
    entropy = token_entropy(processed)
    noise = mx.random.randint(0, vocab_size, argmax.shape, key=k_noise)
    if revealed is None:
        revealed = mx.full(argmax.shape, -1, dtype=mx.int32)
    if fixed is not None:
        mask, tokens = fixed
        argmax = mx.where(mask, tokens, argmax)
        entropy = mx.where(mask, 0.0, entropy)
    if accept_probability is None:
        draw = mx.random.categorical(processed, axis=-1, key=k_draw)
        if fixed is not None:
            draw = mx.where(fixed[0], fixed[1], draw)
        accepted = accept_mask(entropy, bound)
        canvas = mx.where(accepted, draw, noise)
    else:
        if fixed is not None:
            revealed = mx.where(fixed[0], fixed[1], revealed)
        revealed = confidence_reveal(processed, argmax, revealed, accept_probability)
        accepted = revealed >= 0
        canvas = mx.where(accepted, revealed, noise)
    if fixed is not None:
        processed = fixed_logits(processed, *fixed)
    return {"processed": processed, "argmax": argmax, "entropy": entropy, "accepted": accepted,
            "canvas": canvas.astype(mx.int32), "revealed": revealed}


def token_logprobs(processed: mx.array, tokens: mx.array, top: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    """Log-probabilities under softmax(``processed``) (a step's logits [B, C, V]): of ``tokens`` [B, C] and of the ``top`` most likely
    tokens per position, most likely first (ids [B, C, top], log-probabilities [B, C, top]).

    Not part of the compiled step: ``denoise_block`` calls it once per block, on the committing
    step's logits, and only when log-probabilities are asked for.
    """
    x = processed.astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]
    if top <= 0:
        empty = mx.zeros((*tokens.shape, 0))
        return chosen, empty.astype(mx.int32), empty
    ids = mx.argpartition(-logp, top - 1, axis=-1)[..., :top]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


def stop_update(history: mx.array | None, argmax: mx.array, entropy: mx.array, k: int,
                threshold: float) -> tuple[mx.array, mx.array | None]:
    """StableAndConfident as a pure function: (stop [B], new history [k, B, C]).

    Stable: the argmax canvas equals each of the last k; the history starts filled with -1,
    so k + 1 identical canvases in a row are needed (the reference's behaviour).
    Confident: the mean entropy of the temperature-scaled logits is below ``threshold``.
    """
    confident = mx.mean(entropy, axis=-1) < threshold
    if k == 0:
        return confident, history
    if history is None:
        history = initial_history(k, argmax.shape)
    stable = mx.all(history == argmax[None], axis=(0, 2))
    return stable & confident, mx.concatenate([history[1:], argmax[None]], axis=0)


def initial_revealed(shape: tuple[int, ...]) -> mx.array:
    """The revealed canvas of a new block: nothing revealed (-1 everywhere)."""
    return mx.full(shape, -1, dtype=mx.int32)


def initial_history(k: int, shape: tuple[int, ...]) -> mx.array:
    return mx.full((max(1, k), *shape), -1, dtype=mx.int32)


def finalize_block(block: list[int], eos_ids: tuple[int, ...], pad_id: int) -> tuple[list[int], bool]:
    """Pad everything after the first EOS; returns (block, finished)."""
    for i, t in enumerate(block):
        if t in eos_ids:
            return block[: i + 1] + [pad_id] * (len(block) - i - 1), True
    return block, False


def max_tokens_cut(tokens: list[int] | tuple[int, ...], max_tokens: int | None, pad_id: int | None) -> int:
    """How many of ``tokens`` an answer of at most ``max_tokens`` tokens keeps: the core
    generates whole blocks, a caller's limit counts tokens, and padding is none (the cut is
    after the ``max_tokens``-th other one). ``len(tokens)`` where they are within the limit."""
    if max_tokens is None or len(tokens) <= max_tokens:
        return len(tokens)
    counted = 0
    for i, t in enumerate(tokens):
        counted += t != pad_id
        if counted == max_tokens:
            return i + 1
    return len(tokens)
