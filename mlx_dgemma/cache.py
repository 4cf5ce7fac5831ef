"""The KV cache shared by the encoder (writes) and the denoiser (reads).

Sliding layers keep the last ``sliding_window - 1`` positions, exactly what a new token needs
(it sees itself plus ``window - 1`` before it), as transformers' ``DynamicSlidingWindowLayer``
does. Global layers keep every position.

Shapes stay fixed so a compiled denoising step is reused: sliding layers use a ring buffer of
``window - 1`` slots; global layers grow in buckets of ``bucket`` slots. ``pos`` holds each
slot's position (-1 for an empty slot) and the masks are built from it, so unused slots are
never attended and the order of slots does not matter (RoPE is applied before caching).

A decoder pass reads only the filled slots, rounded up (:func:`view_length`): a global
layer's bucket of 1024 slots holding a 27-token prompt would otherwise cost the canvas's
attention 1024 keys instead of 64 (the trained demo: 2/3 of its attention time). The step is
traced once per rounded length, so the rounding keeps retraces to about one per committed
block, fewer as the context grows.

The encoder writes in chunks (``DiffusionGemma.prefill``): a chunk of ``n`` tokens sees the
ring plus itself on sliding layers (``window - 1 + n`` keys, a banded boolean mask) and the
global layer's filled slots, which hold positions ``0 .. offset + n - 1`` in order, so MLX's
bottom-right aligned ``"causal"`` mask is exact there and no mask array is built.
"""

from __future__ import annotations

import mlx.core as mx

from .schema import DEFAULT_BUCKET, ModelArgs


def view_length(filled: int, capacity: int, granule: int) -> int:
    """Slots a decoder pass reads: ``filled`` rounded up to a multiple of ``granule`` (or of a
    quarter of ``filled``'s power of two, when that is larger: at most 4 lengths per doubling,
    at most 25 % of empty slots read), never more than ``capacity``."""
    if filled >= capacity:
        return capacity
    step = max(granule, (1 << max(0, filled.bit_length() - 1)) // 4, 1)
    return min(capacity, -(-max(filled, 1) // step) * step)


class LayerCache:
    def __init__(self, sliding: bool, window: int, bucket: int = DEFAULT_BUCKET, granule: int = 1):
        self.sliding = sliding
        self.window = window
        self.bucket = bucket
        self.granule = granule  # decoder views round the filled slots up to a multiple of this
        self.keys: mx.array | None = None  # [B, Hkv, capacity, D]
        self.values: mx.array | None = None
        self.pos: mx.array | None = None  # [capacity] int32, -1 = empty
        self.count = 0  # positions written so far
        self.reserved = 0  # global layers: allocate at least this many slots on the next growth

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def visible(self) -> int:
        """How many slots, from the first, a decoder pass reads: every filled slot (slots fill
        from 0 on both kinds of layer) and a few empty ones (:func:`view_length`)."""
        return view_length(min(self.count, self.capacity), self.capacity, self.granule)

    def _allocate(self, k: mx.array, v: mx.array, capacity: int) -> None:
        """Create or enlarge the buffers to ``capacity`` slots (new slots empty)."""
        B, H, _, D = k.shape
        extra = capacity - self.capacity
        zk = mx.zeros((B, H, extra, D), dtype=k.dtype)
        zv = mx.zeros((B, H, extra, v.shape[-1]), dtype=v.dtype)
        empty = mx.full((extra,), -1, dtype=mx.int32)
        if self.keys is None:
            self.keys, self.values, self.pos = zk, zv, empty
        else:
            self.keys = mx.concatenate([self.keys, zk], axis=2)
            self.values = mx.concatenate([self.values, zv], axis=2)
            self.pos = mx.concatenate([self.pos, empty])

    def reserve(self, positions: int) -> None:
        """Global layers: size the next growth for ``positions`` in all, so a long prompt
        allocates once instead of copying the cache at every bucket (sliding rings are fixed)."""
        if not self.sliding:
            self.reserved = max(self.reserved, positions)

    def attend(self, k: mx.array, v: mx.array, offset: int | mx.array,
               encode: bool) -> tuple[mx.array, mx.array, mx.array | str | None]:
        """Keys, values and mask for queries at positions ``offset ..``; the encoder also stores.

        Encoder (``offset`` an int): causal (and windowed on sliding layers) over cache + new
        tokens; the mask is ``"causal"`` or ``None`` where that is exact, else boolean [n, S].
        Decoder: the canvas sees every filled cache slot and itself, bidirectionally.
        """
        if encode:
            return self._encode(k, v, int(offset))
        n = k.shape[2]
        if self.keys is None:
            return k, v, None
        m = self.visible()  # the whole array in a step's view, which holds only these slots
        keys = mx.concatenate([self.keys[:, :, :m], k], axis=2)
        values = mx.concatenate([self.values[:, :, :m], v], axis=2)
        visible = mx.concatenate([self.pos[:m] >= 0, mx.ones((n,), dtype=mx.bool_)])
        return keys, values, visible[None, None, None, :]

    def _encode(self, k: mx.array, v: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array | str | None]:
        n = k.shape[2]
        new_pos = mx.arange(offset, offset + n, dtype=mx.int32)
        if not self.sliding:
            # store first: the filled slots are then exactly positions 0 .. offset + n - 1
            self._store(k, v, new_pos)
            end = self.count
            return self.keys[:, :, :end], self.values[:, :, :end], "causal" if n > 1 else None
        if self.keys is None:  # first chunk: only itself; the window binds only past `window` tokens
            keys, values = k, v
            mask = ("causal" if n > 1 else None) if n <= self.window else _banded(new_pos, new_pos, self.window)
        else:
            keys = mx.concatenate([self.keys, k], axis=2)
            values = mx.concatenate([self.values, v], axis=2)
            mask = _banded(new_pos, mx.concatenate([self.pos, new_pos]), self.window)
        self._store(k, v, new_pos)
        return keys, values, mask

    def _store(self, k: mx.array, v: mx.array, new_pos: mx.array) -> None:
        n = k.shape[2]
        if self.sliding:
            ring = self.window - 1
            if self.keys is None:
                self._allocate(k, v, ring)
            m = min(n, ring)
            slots = new_pos[-m:] % ring
            self.keys[:, :, slots] = k[:, :, -m:]
            self.values[:, :, slots] = v[:, :, -m:]
            self.pos[slots] = new_pos[-m:]
        else:
            need = self.count + n
            if need > self.capacity:
                self._allocate(k, v, -(-max(need, self.reserved) // self.bucket) * self.bucket)
            self.keys[:, :, self.count:need] = k
            self.values[:, :, self.count:need] = v
            self.pos[self.count:need] = new_pos
        self.count += n

    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values, self.pos]

    def step_state(self) -> list[mx.array]:
        """:meth:`state` cut to the slots a decoder pass reads (:meth:`visible`)."""
        if self.keys is None:
            return []
        m = self.visible()
        return [self.keys[:, :, :m], self.values[:, :, :m], self.pos[:m]]

    def checkpoint(self) -> tuple:
        """What :meth:`rollback` needs to return here: the position count, and on sliding
        layers a copy of the ring (later positions overwrite its slots); a global layer only
        appends, so its count is enough."""
        ring = None
        if self.sliding and self.keys is not None:
            ring = (mx.array(self.keys), mx.array(self.values), mx.array(self.pos))
        return self.count, ring

    def rollback(self, checkpoint: tuple) -> None:
        """Forget every position written since ``checkpoint`` was taken."""
        count, ring = checkpoint
        if self.sliding:
            if ring is None:
                self.keys = self.values = self.pos = None
            else:
                self.keys, self.values, self.pos = (mx.array(a) for a in ring)
        elif self.pos is not None and count < self.count:
            self.pos[count:] = -1  # emptied slots are never attended (masks are built from pos)
        self.count = count

    def with_state(self, arrays: list[mx.array]) -> "LayerCache":
        """A read-only view over given arrays (used inside a compiled step)."""
        view = LayerCache(self.sliding, self.window, self.bucket, self.granule)
        if arrays:
            view.keys, view.values, view.pos = arrays
        view.count = self.count
        return view


def _banded(q_pos: mx.array, k_pos: mx.array, window: int) -> mx.array:
    """Causal sliding-window mask [n, S] from positions (-1 marks an empty slot)."""
    q, kp = q_pos[:, None], k_pos[None, :]
    return (kp >= 0) & (kp <= q) & (q - kp < window)


class KVCache:
    """Per-layer caches plus the number of positions encoded so far."""

    def __init__(self, args: ModelArgs, bucket: int = DEFAULT_BUCKET):
        self.layers = [LayerCache(args.is_sliding(i), args.sliding_window, bucket, args.canvas_length)
                       for i in range(args.num_hidden_layers)]
        self.offset: int | mx.array = 0

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def advance(self, n: int) -> None:
        self.offset += n

    def reserve(self, positions: int) -> None:
        """Allocate the global layers for ``positions`` in all at their next growth."""
        for c in self.layers:
            c.reserve(positions)

    def state(self) -> list[mx.array]:
        return [a for c in self.layers for a in c.state()]

    def step_state(self) -> list[mx.array]:
        """What a decoder pass reads of every layer (see :meth:`LayerCache.step_state`)."""
        return [a for c in self.layers for a in c.step_state()]

    def checkpoint(self) -> tuple:
        """A point :meth:`rollback` can return to (costs a copy of the sliding layers' rings)."""
        return int(self.offset), [c.checkpoint() for c in self.layers]

    def rollback(self, checkpoint: tuple) -> None:
        """Return to ``checkpoint``: positions written since are forgotten, as if never encoded."""
        offset, layers = checkpoint
        for c, ck in zip(self.layers, layers):
            c.rollback(ck)
        self.offset = offset

    def view(self, arrays: list[mx.array], offset: mx.array) -> "KVCache":
        """A view with the given state arrays and an array offset (for mx.compile)."""
        v = KVCache.__new__(KVCache)
        v.layers, i = [], 0
        for c in self.layers:
            k = len(c.state())
            v.layers.append(c.with_state(arrays[i:i + k]))
            i += k
        v.offset = offset
        return v

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())
