"""The KV cache shared by the encoder (writes) and the denoiser (reads).

Global layers keep every position; sliding layers keep the last ``sliding_window - 1``
positions, exactly what a new token needs (it sees itself plus ``window - 1`` before it),
as transformers' ``DynamicSlidingWindowLayer`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # pragma: no cover
    from .model import ModelArgs


class LayerCache:
    def __init__(self, sliding: bool, window: int):
        self.sliding = sliding
        self.window = window
        self.keys: mx.array | None = None  # [B, Hkv, T, D]
        self.values: mx.array | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def attend(self, k: mx.array, v: mx.array, offset: int, encode: bool):
        """Keys, values and mask for queries at positions ``offset ..``; the encoder also stores.

        Encoder: causal (and windowed on sliding layers) over cache + new tokens.
        Decoder: no mask at all; the canvas sees the cache window and itself.
        """
        past = self.length
        if past:
            keys = mx.concatenate([self.keys, k], axis=2)
            values = mx.concatenate([self.values, v], axis=2)
        else:
            keys, values = k, v
        if not encode:
            return keys, values, None
        n = k.shape[2]
        q_pos = mx.arange(offset, offset + n)[:, None]
        k_pos = mx.arange(offset - past, offset + n)[None, :]
        mask = k_pos <= q_pos
        if self.sliding:
            mask = mask & (q_pos - k_pos < self.window)
            keep = self.window - 1
            self.keys, self.values = keys[:, :, -keep:], values[:, :, -keep:]
        else:
            self.keys, self.values = keys, values
        return keys, values, mask


class KVCache:
    """Per-layer caches plus the number of positions encoded so far."""

    def __init__(self, args: "ModelArgs"):
        self.layers = [LayerCache(args.is_sliding(i), args.sliding_window)
                       for i in range(args.num_hidden_layers)]
        self.offset = 0

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def advance(self, n: int) -> None:
        self.offset += n

    def state(self) -> list[mx.array]:
        return [a for c in self.layers if c.keys is not None for a in (c.keys, c.values)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())
