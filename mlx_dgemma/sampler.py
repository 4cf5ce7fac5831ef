"""The reference sampler, on the device: linear temperature schedule, one step's draws and
entropies (the acceptance mode, EntropyBound by default, is :mod:`mlx_dgemma.acceptance`'s),
StableAndConfident stopping (``generation_diffusion_gemma.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any

import mlx.core as mx

from . import params as registry
from .acceptance import Acceptance, acceptance_of
from .acceptance import accept_mask, confidence_reveal  # noqa: F401 (their home moved; the names stay here)
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
        """The model's defaults (``cfg``: its generation_config) with ``overrides`` (None: not
        given), checked: each field's range, then the rules between fields (the error names
        the field given)."""
        names = {f.name for f in fields(cls)}
        base = {k: v for k, v in (cfg or {}).items() if k in names}
        unknown = set(overrides) - names
        if unknown:
            raise ParameterError(f"unknown generation parameter(s) {sorted(unknown)}; known: {sorted(names)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        p = cls(**_tuples({**base, **given}))
        p.validate(given, defaults=base if given else None)
        return p

    def with_overrides(self, **kw: Any) -> "SamplerParams":
        given = {k: v for k, v in kw.items() if v is not None}
        p = replace(self, **_tuples(given))
        p.validate(given, defaults={f.name: getattr(self, f.name) for f in fields(self)})
        return p

    def validate(self, given: Any = (), defaults: dict[str, Any] | None = None) -> None:
        """Check every field (types, finite ranges), then the rules between them
        (``mlx_dgemma.params.ORDERS``; one acceptance mode at most, :func:`acceptance_of`);
        ParameterError names the field. ``given``: the fields a caller set (the error names one of
        them); ``defaults``: the values before its overrides, quoted in the error (the model's own,
        not the reference's: the demo's are 0.05 and 0.25)."""
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        registry.check_orders(values, given, {**values_of(SamplerDefaults()), **defaults} if defaults is not None
                              else None)
        acceptance_of(self)  # at most one acceptance mode selected

    def check_model(self, vocab_size: int) -> None:
        """Checks that need the model: ``sc_top_k`` at most the vocabulary."""
        if self.sc_top_k is not None and self.sc_top_k > vocab_size:
            raise ParameterError(f"sc_top_k = {self.sc_top_k}: must be at most the vocabulary size "
                                 f"({vocab_size})", param="sc_top_k", rule=f"an integer in [1, {vocab_size}]")


def values_of(p: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict (shallow: tuples stay tuples)."""
    return {f.name: getattr(p, f.name) for f in fields(p)}


def _tuples(values: dict[str, Any]) -> dict[str, Any]:
    """``eos_token_id`` as a tuple (generation_config.json and requests give a list or one id)."""
    eos = values.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return {**values, "eos_token_id": (eos,)}
    if isinstance(eos, list):
        return {**values, "eos_token_id": tuple(eos)}
    return values


# A registry parameter the class does not declare yet gets a field here (None = off): a new
# parameter reaches generation from its registry entry alone, for the code that reads it.
_UNDECLARED = [(p.name, p.kind | None, field(default=None)) for p in registry.PARAMS
               if p.name not in {f.name for f in fields(SamplerParams)}]
if _UNDECLARED:
    SamplerParams = make_dataclass("SamplerParams", _UNDECLARED, bases=(SamplerParams,), frozen=True,  # type: ignore[misc]
                                   namespace={"__module__": __name__})


def temperature(steps_left: int, p: SamplerParams) -> float:
    """Linear schedule; ``steps_left`` counts down N..1, so step 1 of N gets t_max."""
    return p.t_min + (p.t_max - p.t_min) * (steps_left / p.max_denoising_steps)


def token_entropy(logits: mx.array) -> mx.array:
    """Entropy of softmax(logits) per position (as torch's Categorical(logits=...).entropy())."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(logp)
    return -mx.sum(mx.where(p > 0, p * logp, 0.0), axis=-1)


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
                fixed: tuple[mx.array, mx.array] | None = None,
                acceptance: Acceptance | None = None) -> dict[str, mx.array]:
    """One step of the sampler on the decoder's logits [B, C, V].

    Returns processed logits (the next self-conditioning input), the argmax canvas, the
    per-position entropy, the accepted mask, the next canvas and the revealed canvas.
    ``acceptance`` (:mod:`mlx_dgemma.acceptance`) picks the accepted positions and the next
    canvas; None: the mode ``bound`` and ``accept_probability`` select (EntropyBound, or the
    confidence threshold when ``accept_probability`` is given).

    ``fixed`` (mask [B, C], tokens [B, C]; a canvas template, :mod:`mlx_dgemma.canvas`): those
    positions hold their token in the canvas and the argmax, are accepted with zero entropy
    (they use none of the EntropyBound budget and count as confident for stopping) and are
    one-hot in the processed logits. None (the default) adds nothing to the graph.
    """
    if acceptance is None:
        acceptance = acceptance_of(SamplerParams(entropy_bound=bound, accept_probability=accept_probability))
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
    accepted, canvas, revealed = acceptance.select(
        processed, argmax, entropy, lambda x=processed: mx.random.categorical(x, axis=-1, key=k_draw), noise,
        revealed, fixed)
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
