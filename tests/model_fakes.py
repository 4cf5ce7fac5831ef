"""Scripted decoders for the generation loop's tests: real shapes (a ``ModelArgs`` with no
layers) and a real, empty ``KVCache``, so they pass through the same code as the model;
only ``denoise`` (and the prefill calls) are scripted."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dgemma.cache import KVCache
from mlx_dgemma.schema import ModelArgs


def layerless_args(canvas_length: int, vocab_size: int, max_position_embeddings: int = 10_000) -> ModelArgs:
    """The shape of a decoder with no layers: its cache holds nothing, its memory estimate is
    the sampler's [canvas, vocab] arrays alone."""
    return ModelArgs(hidden_size=8, intermediate_size=8, num_hidden_layers=0, num_attention_heads=1,
                     num_key_value_heads=1, num_global_key_value_heads=1, head_dim=8, global_head_dim=8,
                     layer_types=[], sliding_window=canvas_length, rope_parameters={}, vocab_size=vocab_size,
                     num_experts=1, top_k_experts=1, moe_intermediate_size=8,
                     max_position_embeddings=max_position_embeddings, canvas_length=canvas_length)


class ScriptedDecoder:
    """Returns ``logits[i]`` at its i-th ``denoise`` call; records the self-conditioning inputs."""

    group = None  # one process
    activation_dtype = mx.float32

    def __init__(self, logits, canvas_length: int, vocab_size: int):
        self.logits, self.calls, self.sc_inputs = logits, 0, []
        self.args = layerless_args(canvas_length, vocab_size)

    def make_cache(self) -> KVCache:
        return KVCache(self.args)

    def denoise(self, canvas, cache, sc, dtype=None, sc_top_k=None):
        self.sc_inputs.append(None if sc is None else np.array(sc))
        out = mx.array(self.logits[self.calls])
        self.calls += 1
        return out
