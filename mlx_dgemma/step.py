"""One denoising step as a single compiled MLX graph: decoder pass, sampler and stopping rule.

Everything that changes between steps is an input (canvas, self-conditioning logits,
temperature, random key, stability history, cache arrays, cache offset), so the graph is
traced once per cache shape. Sliding layers have fixed-size caches and global layers grow
in buckets, so a new block reuses the trace until a bucket fills.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .acceptance import acceptance_of, traced_fields
from .cache import KVCache
from .distributed import all_finite, sharded_sample_step, size_of
from .model import DiffusionGemma
from .sampler import SamplerParams, initial_history, initial_revealed, sample_step, stop_update

OUTPUTS = ("canvas", "argmax", "accepted", "entropy", "processed", "stop", "history", "finite", "revealed")

# The sampler fields the traced graph bakes in as constants besides the acceptance mode's own
# (mlx_dgemma.acceptance: each mode declares them); the others (steps, temperatures, seed, token
# budget) are inputs or loop bounds, so two requests differing only in them can share one trace.
TRACED_FIELDS = ("stability_threshold", "confidence_threshold", "sc_top_k")


def step_key(params: SamplerParams, dtype: mx.Dtype) -> tuple:
    """What a traced step depends on: two requests with the same key can share one trace
    (:meth:`mlx_dgemma.runtime.Runtime.step` keeps one StepFunction per key). The modes' fields are
    read when asked: a mode registered after this module's import keys the trace too."""
    return tuple(getattr(params, f) for f in (*TRACED_FIELDS, *traced_fields())), str(dtype)


def effective_sc_top_k(params: SamplerParams, vocab_size: int, precision_sc_top_k: int | None) -> int | None:
    """The self-conditioning top-k a step runs with: the request's ``sc_top_k``, else the runtime
    precision's (fast: ``FAST_SC_TOP_K``); None = the whole vocabulary (exact). The one place of
    this rule: the step, ``Runtime.sc_top_k`` and the trace headers read it."""
    k = params.sc_top_k if params.sc_top_k is not None else precision_sc_top_k
    return None if k is None or k >= vocab_size else k


class StepFunction:
    """``step(canvas, sc_logits | None, temperature, key, history, cache, revealed=None) -> dict`` of
    OUTPUTS (``revealed``: the block's revealed canvas, -1 where hidden, for an acceptance mode
    that keeps positions: the confidence threshold's; ``acceptance``: the mode, chosen once).

    ``dtype``: the activations' (default: the model's own ``activation_dtype``, set by its runtime
    precision: a fast model stepped in float32 ran 4x slower on a GPU, float32 activations against
    bfloat16 scales); ``precision_sc_top_k``: the runtime precision's self-conditioning
    width (a request's ``sc_top_k`` wins). Generation takes the runtime's shared one
    (:meth:`mlx_dgemma.runtime.Runtime.step`) rather than tracing a new one per answer."""

    def __init__(self, model: DiffusionGemma, params: SamplerParams, dtype: mx.Dtype | None = None,
                 compile: bool = True, precision_sc_top_k: int | None = None):
        params.check_model(model.args.vocab_size)
        # the acceptance mode, chosen once (refused under mlx.launch where it runs in one process only)
        self.acceptance = acceptance_of(params, size_of(model.group))
        self.model, self.params = model, params
        self.sc_top_k = effective_sc_top_k(params, model.args.vocab_size, precision_sc_top_k)
        self.dtype = dtype or model.activation_dtype  # the runtime precision's activations
        self.compiled = compile
        self._fns: dict[tuple[bool, bool], Callable] = {}
        self._cache: KVCache | None = None

    def _fn(self, with_sc: bool, with_fixed: bool = False) -> Callable:
        # a canvas template's step is its own trace: the default step's graph stays as it was
        if (with_sc, with_fixed) not in self._fns:
            body = self._body(with_sc, with_fixed)
            self._fns[with_sc, with_fixed] = mx.compile(body) if self.compiled else body
        return self._fns[with_sc, with_fixed]

    def _body(self, with_sc: bool, with_fixed: bool = False) -> Callable:
        model, p, dtype = self.model, self.params, self.dtype
        sc_top_k, acceptance = self.sc_top_k, self.acceptance

        def body(canvas, sc, temp, key, history, revealed, offset, *state):
            if with_fixed:  # the template's mask and tokens come first among the cache arrays
                fixed, state = (state[0], state[1]), state[2:]
            else:
                fixed = None
            cache = self._cache.view(list(state), offset)  # the cache as a view over the traced inputs
            logits = model.denoise(canvas, cache, sc if with_sc else None, dtype=dtype, sc_top_k=sc_top_k)
            group = model.group
            if group is None:
                out = sample_step(logits, temp, p.entropy_bound, model.args.vocab_size, key, revealed=revealed,
                                  fixed=fixed, acceptance=acceptance)
            else:  # logits hold this rank's vocabulary: the sampler's reductions go across ranks
                # (a mode that runs across ranks only: the constructor refuses the others)
                out = sharded_sample_step(logits, temp, acceptance, model.args.vocab_size, key, model.vocab[0],
                                          group, fixed, revealed)
            stop, new_history = stop_update(history, out["argmax"], out["entropy"], p.stability_threshold,
                                            p.confidence_threshold)
            stop = acceptance.stop(stop, out["accepted"])  # a mode's own end of the block
            # one flag in the same graph (no extra sync): NaN/Inf logits become an error, not a blank answer
            finite = mx.all(mx.isfinite(logits)) if group is None else all_finite(logits, group)
            return (out["canvas"], out["argmax"], out["accepted"], out["entropy"], out["processed"], stop,
                    new_history, finite, out["revealed"])

        return body

    def initial_history(self, shape: tuple[int, ...]) -> mx.array:
        return initial_history(self.params.stability_threshold, shape)

    def __call__(self, canvas: mx.array, sc: mx.array | None, temperature: float, key: mx.array,
                 history: mx.array, cache: KVCache, revealed: mx.array | None = None,
                 fixed: tuple[mx.array, mx.array] | None = None) -> dict[str, mx.array]:
        """``fixed``: a canvas template's (mask [1, C] bool, tokens [1, C] int32), held at every step."""
        self._cache = cache
        state = cache.step_state()  # the filled slots: one trace per rounded length
        offset = mx.array(cache.offset, dtype=mx.int32)
        revealed = revealed if revealed is not None else initial_revealed(canvas.shape)
        extra = list(fixed) if fixed is not None else []
        try:
            out = self._fn(sc is not None, fixed is not None)(
                canvas, sc if sc is not None else mx.zeros((1,)), mx.array(temperature, dtype=mx.float32), key,
                history, revealed, offset, *extra, *state)
        finally:
            self._cache = None  # only read while tracing; a shared step must not keep a finished answer's cache alive
        return dict(zip(OUTPUTS, out))
