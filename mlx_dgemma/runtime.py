"""The loaded model as one typed object: what ``load()`` returns and generation takes.

A :class:`Runtime` holds the model and everything that belongs with it but is not a model
parameter: the tokenizer, the generation defaults (generation_config.json or the GGUF's
``diffusion.eb_*`` keys), the runtime precision, which demo it is (if any) and the compiled
denoising steps traced for it. Nothing is hung on the model itself: the model is the
network, the runtime is the network as loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import mlx.core as mx

from .errors import ParameterError
from .model import DiffusionGemma, ModelArgs
from .precision import Precision
from .sampler import SamplerParams
from .step import StepFunction, effective_sc_top_k, step_key
from .tokenizer import Tokenizer

EXACT = Precision("exact", mx.float32)


@dataclass(frozen=True, eq=False)
class Runtime:
    """A model ready to generate: ``generate(runtime, prompt)``, ``stream_generate``, ``ChatSession``.

    Built by :func:`mlx_dgemma.load` (and the demo's :func:`mlx_dgemma.load_demo`); a model
    built another way (tests) becomes one with ``Runtime(model, tokenizer)``: exact precision, the
    reference's sampler defaults. ``precision`` must be the one the model's weights are in
    (:func:`mlx_dgemma.precision.apply_precision` changes them in place: make a new Runtime after
    it, so no step traced for the old weights is reused).
    """

    model: DiffusionGemma
    tokenizer: Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)  # the model's sampler defaults
    precision: Precision = EXACT  # the runtime precision the weights are in
    demo_kind: str | None = None  # "trained" | "random" for the built-in demo; None for a real model
    # --memory-limit: the one budget, the plan's and every prompt's (None: what the device offers)
    memory_limit: int | None = None
    # the compiled steps traced for this model, by traced sampler fields and dtype (:meth:`step`)
    steps: dict[tuple, StepFunction] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # duck-typed (tests pass scripted decoders): what generation calls on each
        if not hasattr(self.model, "make_cache") or not hasattr(self.tokenizer, "decode"):
            raise ParameterError(f"Runtime(model, tokenizer): got ({type(self.model).__name__}, "
                                 f"{type(self.tokenizer).__name__}); expected (DiffusionGemma, Tokenizer), or use "
                                 "mlx_dgemma.load(path), which builds the Runtime", param="runtime")
        if self.model.activation_dtype != self.precision.dtype:  # apply_precision sets both
            raise ParameterError(f"precision: {self.precision.label} does not match the model's activations "
                                 f"({self.model.activation_dtype}); pass the precision the model was put in")

    @property
    def is_demo(self) -> bool:
        return self.demo_kind is not None

    @property
    def activation_dtype(self) -> mx.Dtype:
        """The precision's activation dtype (float32 for exact)."""
        return self.precision.dtype

    @property
    def group(self) -> mx.distributed.Group | None:
        """The tensor-parallel group the model is sharded over (None: one process)."""
        return self.model.group

    @cached_property
    def rank_args(self) -> ModelArgs:
        """The shapes this process computes with, for memory estimates: the model's own, or under
        ``mlx.launch`` this rank's share (its attention and key/value heads, its slice of the
        MLP and expert widths: ``plan.rank_args``), so a sharded model's prompt is priced at
        what this rank holds, not at the whole model."""
        if self.group is None:
            return self.model.args
        from .distributed import rank_of, size_of
        from .plan import rank_args

        return rank_args(self.model.args, size_of(self.group), rank_of(self.group))[0]

    @cached_property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters (what the plan priced as weights)."""
        from mlx.utils import tree_flatten

        return sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))

    def prompt_budget(self, cache_bytes: int) -> tuple[int | None, str | None]:
        """(bytes a prompt may still use, where they come from) under ``memory_limit``: the
        limit less the weights and the ``cache_bytes`` already held (or what MLX holds, if
        more); (None, None) without one (the device's figure, :func:`memory.available_bytes`)."""
        if self.memory_limit is None:
            return None, None
        from .memory import available_bytes

        return available_bytes(self.memory_limit, self.weights_bytes + cache_bytes), "--memory-limit"

    def sc_top_k(self, params: SamplerParams) -> int | None:
        """The self-conditioning top-k a step under ``params`` runs with (None: the whole vocabulary)."""
        return effective_sc_top_k(params, self.model.args.vocab_size, self.precision.sc_top_k)

    def step(self, params: SamplerParams, dtype: mx.Dtype | None = None) -> StepFunction:
        """The compiled step for these traced sampler fields, built once per runtime.

        Each new StepFunction traces its graph again (a fraction of a second on the demo, more
        on a deep model), so every answer of a chat, a server or the chat app reuses one.
        Generation runs one step at a time per model (the chat app's worker, the server's
        single model worker); a step function is not re-entrant.
        """
        params.check_model(self.model.args.vocab_size)
        dtype = dtype or self.activation_dtype
        key = step_key(params, dtype)
        fn = self.steps.get(key)
        if fn is None:
            fn = self.steps[key] = StepFunction(self.model, params, dtype, precision_sc_top_k=self.precision.sc_top_k)
        return fn


def check_runtime(runtime: Any, where: str, extra: tuple = ()) -> None:
    """Raise a ParameterError that says what to do when ``where`` (``generate()``, ...) was given
    something else than a :class:`Runtime` first: mlx-lm's ``(model, tokenizer, prompt)``, the
    model alone, or a path not loaded yet."""
    how = f"runtime = mlx_dgemma.load(path) (or load_demo()), then {where}(runtime, ...)"
    if isinstance(runtime, Runtime):
        if extra:
            raise ParameterError(f"{where}(): takes (runtime, prompt) and the rest by name, got {len(extra)} more "
                                 f"positional argument(s); e.g. {where}(runtime, prompt, max_new_tokens=64)",
                                 param="runtime")
        return
    if isinstance(runtime, DiffusionGemma) or isinstance(runtime, Tokenizer) or extra:
        got = "a model and a tokenizer (mlx-lm's form)" if extra else f"a {type(runtime).__name__}"
        raise ParameterError(f"{where}(): got {got}; it takes one Runtime, which holds the model, its tokenizer "
                             f"and defaults: {how}", param="runtime")
    if isinstance(runtime, (str, os.PathLike)):
        raise ParameterError(f"{where}(): got the path {str(runtime)!r}, not a loaded model; {how}", param="runtime")
    raise ParameterError(f"{where}(): expected a Runtime first, got {type(runtime).__name__}; {how}",
                         param="runtime")
