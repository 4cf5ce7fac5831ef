"""DiffusionGemma in MLX: a causal encoder that fills a KV cache, and a bidirectional denoiser
over a canvas that reads it.

Mirrors ``transformers/models/diffusion_gemma/modeling_diffusion_gemma.py``. Encoder and
decoder share every weight except the per-layer output scalar. No I/O and no sampling here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCache, LayerCache
from .distributed import Range, Split, even, global_softmax_stats, shard_module, vocab_range
from .errors import ParameterError
from .quantized import FloatEmbedding
from .schema import ATTENTION_SCORES_BUDGET, DEFAULT_PREFILL_CHUNK, ModelArgs
from .switch_layers import SwitchLinear, gather_sort, scatter_unsort

# Token-expert pairs at or above this count are sorted by expert before gather_qmm.
_SORT_THRESHOLD = 64

# Entries per chunk of top_k_indices' first stage: 2,048 is the longest row MLX's Metal sort
# handles in one threadgroup (512 threads x 4); a longer row (the vocabulary, 262,144) goes to
# its multi-block merge sort, which argpartition falls back to on Metal and CUDA.
TOP_K_CHUNK = 2048


def _gelu(x: mx.array) -> mx.array:
    # transformers' gelu_pytorch_tanh
    return nn.gelu_approx(x)


def top_k_indices(x: mx.array, k: int, chunk: int | None = None) -> mx.array:
    """Indices [..., k] of the ``k`` largest entries of each row of ``x`` (last axis), in no
    particular order: the set ``mx.argpartition(-x, k - 1)[..., :k]`` selects (ties aside).

    MLX's Metal and CUDA backends run ``argpartition`` as a full sort of the row: over the
    vocabulary (256 x 262,144 probabilities per step) a multi-block merge sort holding two
    copies of the values and two of the indices (about 1.3 GB in all with its output). A row
    that splits into at least four whole chunks is taken in two stages instead: the top ``k``
    of each ``chunk`` entries (a sort that fits one threadgroup), then the top ``k`` of those
    candidates. Every one of the row's top ``k`` is among its own chunk's top ``k``, so the set is
    the same; the largest transient is the first stage's index array (one copy of ``x``'s size).
    Other rows (a small vocabulary, ``k`` above a quarter of a chunk) take one ``argpartition``.
    ``chunk``: default :data:`TOP_K_CHUNK`. ``benchmarks/sc_select.py`` measures both ways
    (benchmarks/RESULTS.md).
    """
    chunk = chunk or TOP_K_CHUNK
    V = x.shape[-1]
    n = V // chunk
    if V % chunk or n < 4 or k > chunk // 4:
        return mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
    lead = x.shape[:-1]
    chunks = x.reshape(*lead, n, chunk)
    local = mx.argpartition(chunks, kth=chunk - k, axis=-1)[..., chunk - k:]  # [..., n, k] each chunk's top k
    cand = mx.take_along_axis(chunks, local, axis=-1).reshape(*lead, n * k)
    ids = (local + (mx.arange(n, dtype=local.dtype) * chunk)[:, None]).reshape(*lead, n * k)
    best = mx.argpartition(cand, kth=n * k - k, axis=-1)[..., n * k - k:]  # [..., k] the row's top k
    return mx.take_along_axis(ids, best, axis=-1)


def rms_norm(x: mx.array, eps: float) -> mx.array:
    """RMS norm without a weight (the v norm, the router's and self-conditioning's post norm)."""
    return mx.fast.rms_norm(x, None, eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.sliding = args.is_sliding(layer_idx)
        self.n_heads = args.num_attention_heads
        self.head_dim = args.head_dim if self.sliding else args.global_head_dim
        self.n_kv = args.num_key_value_heads if self.sliding else args.num_global_key_value_heads
        self.eps = args.rms_norm_eps
        h = args.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        if self.sliding:  # global layers have no V projection: V is the raw K projection
            self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        rope = args.rope_parameters["sliding_attention" if self.sliding else "full_attention"]
        self.rope_base = float(rope["rope_theta"])
        self.group: mx.distributed.Group | None = None  # set by DiffusionGemma.shard

    def head_splits(self, ranks: int, rank: int) -> tuple[Range, Range]:
        """This rank's query heads and key/value heads (a key/value head is replicated on the
        ranks sharing it when there are fewer of them than ranks)."""
        q_lo, q_hi = even(self.n_heads, ranks, rank, "attention heads")
        per_kv = self.n_heads // self.n_kv  # query heads per key/value head
        if (q_hi - q_lo) % per_kv == 0:
            return (q_lo, q_hi), (q_lo // per_kv, q_hi // per_kv)
        if per_kv % (q_hi - q_lo) == 0:
            return (q_lo, q_hi), (q_lo // per_kv, q_lo // per_kv + 1)
        raise ParameterError(f"{self.n_heads} query heads over {self.n_kv} key/value heads cannot be split "
                             f"over {ranks} ranks; run with a number of ranks that divides both")

    def rope(self, x: mx.array, offset: int, freqs: mx.array | None) -> mx.array:
        if freqs is None:
            return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_base, scale=1.0,
                                offset=offset)
        return mx.fast.rope(x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=freqs)

    def keys_values(self, x: mx.array, offset: int, freqs: mx.array | None) -> tuple[mx.array, mx.array]:
        """This layer's keys and values [B, Hkv, L, D] for ``x`` at positions ``offset ..``."""
        B, L, _ = x.shape
        k_raw = self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim) if self.sliding else k_raw
        k = self.rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset, freqs)
        return k, rms_norm(v, self.eps).transpose(0, 2, 1, 3)

    def write_cache(self, x: mx.array, cache: LayerCache, offset: int, freqs: mx.array | None) -> None:
        """Encoder pass that only stores keys and values (the last layer: nothing reads its output)."""
        k, v = self.keys_values(x, offset, freqs)
        cache.attend(k, v, offset, encode=True)

    def __call__(self, x: mx.array, cache: LayerCache, offset: int, encode: bool,
                 freqs: mx.array | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        q = self.rope(self.q_norm(q).transpose(0, 2, 1, 3), offset, freqs)  # [B, H, L, D]
        k, v = self.keys_values(x, offset, freqs)  # [B, Hkv, L, D]
        keys, values, mask = cache.attend(k, v, offset, encode)
        if encode:
            out = bounded_attention(q, keys, values, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, H*D]
        out = self.o_proj(out)
        if self.group is not None:  # each rank's heads give a partial sum of the projection
            out = mx.distributed.all_sum(out, group=self.group)
        return out


def bounded_attention(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | str | None,
                      budget: int = ATTENTION_SCORES_BUDGET) -> mx.array:
    """``scaled_dot_product_attention`` (scale 1) over query blocks whose scores fit ``budget``.

    Queries are independent, so splitting them is exact. With the bottom-right aligned
    ``"causal"`` mask a block ending at query ``b`` needs only the first ``S - L + b`` keys,
    which also skips the masked future of earlier blocks.
    """
    B, H, L, _ = q.shape
    S = keys.shape[2]
    rows = max(1, budget // (B * H * S * 4))
    if rows >= L:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
    outs = []
    for a in range(0, L, rows):
        b = min(L, a + rows)
        if isinstance(mask, str):  # "causal"
            end = S - L + b
            out = mx.fast.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, :end], values[:, :, :end],
                                                       scale=1.0, mask="causal")
        else:
            m = None if mask is None else mask[..., a:b, :]
            out = mx.fast.scaled_dot_product_attention(q[:, :, a:b], keys, values, scale=1.0, mask=m)
        # evaluated block by block: left lazy, MLX schedules the blocks side by side and all
        # their scores are alive at once (measured: the same peak as one unsplit call)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=2)


class MLP(nn.Module):
    """Gated GELU MLP (the dense branch, and the self-conditioning block)."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(_gelu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k softmax router fed the *un-normalized* residual stream."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.top_k = args.top_k_experts
        self.root = args.hidden_size**-0.5
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))

    def __call__(self, h: mx.array) -> tuple[mx.array, mx.array]:
        x = rms_norm(h, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(x).astype(mx.float32), axis=-1)
        idx = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        w = mx.take_along_axis(probs, idx, axis=-1)
        w = w / w.sum(axis=-1, keepdims=True)
        return idx, w * self.per_expert_scale[idx]


class Experts(nn.Module):
    """Stacked experts; gate and up fused in one tensor (gate rows first)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.inter = i
        self.gate_up_proj = SwitchLinear(h, 2 * i, e, bias=False)
        self.down_proj = SwitchLinear(i, h, e, bias=False)

    def gated(self, gu: mx.array) -> mx.array:
        """The experts' activation: gelu(gate) * up of a fused gate/up output [..., 2I] -> [..., I]."""
        return _gelu(gu[..., : self.inter]) * gu[..., self.inter:]

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        shape = x.shape
        x = mx.expand_dims(x.reshape(-1, shape[-1]), (-2, -3))  # [N, 1, 1, H]
        idx = idx.reshape(-1, idx.shape[-1])  # [N, K]
        do_sort = idx.size >= _SORT_THRESHOLD
        inv = None
        ids = idx
        if do_sort:
            x, ids, inv = gather_sort(x, idx)
        gu = self.gate_up_proj(x, ids, sorted_indices=do_sort)  # [., 1, 2I]
        y = self.down_proj(self.gated(gu), ids, sorted_indices=do_sort)  # [., 1, H]
        if do_sort:
            y = scatter_unsort(y, inv, idx.shape)  # [N, K, 1, H]
        y = y.squeeze(-2)  # [N, K, H]
        y = (y * weights.reshape(-1, weights.shape[-1], 1).astype(y.dtype)).sum(axis=-2)
        return y.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(h, args.intermediate_size)
        self.router = Router(args)
        self.experts = Experts(args)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm_1 = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.layer_scalar = mx.ones((1,))  # decoder (canvas) pass
        self.encoder_layer_scalar = mx.ones((1,))  # encoder (prompt, committed canvas) pass
        self.group: mx.distributed.Group | None = None  # set by DiffusionGemma.shard

    def __call__(self, x: mx.array, cache: LayerCache, offset: int, encode: bool,
                 freqs: mx.array | None) -> mx.array:
        r = x
        h = self.self_attn(self.input_layernorm(x), cache, offset, encode, freqs)
        h = r + self.post_attention_layernorm(h)
        dense = self.mlp(self.pre_feedforward_layernorm(h))
        idx, w = self.router(h)
        moe = self.experts(self.pre_feedforward_layernorm_2(h), idx, w)
        if self.group is not None:  # both branches' partial sums in one all-reduce: [B, L, 2H]
            both = mx.distributed.all_sum(mx.concatenate([dense, moe], axis=-1), group=self.group)
            dense, moe = both[..., : dense.shape[-1]], both[..., dense.shape[-1]:]
        dense = self.post_feedforward_layernorm_1(dense)
        moe = self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(dense + moe)
        scalar = self.encoder_layer_scalar if encode else self.layer_scalar
        return h * scalar.astype(h.dtype)


class SelfConditioning(nn.Module):
    """Previous step's soft embeddings -> gated MLP -> added to the canvas -> unweighted norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.pre_norm = nn.RMSNorm(args.hidden_size, eps=self.eps)
        mlp = MLP(args.hidden_size, args.intermediate_size)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.group: mx.distributed.Group | None = None  # set by DiffusionGemma.shard

    def __call__(self, embeds: mx.array, soft: mx.array | None) -> mx.array:
        if soft is not None:  # a zero signal contributes exactly zero (step 1)
            n = self.pre_norm(soft)
            y = self.down_proj(_gelu(self.gate_proj(n)) * self.up_proj(n))
            if self.group is not None:
                y = mx.distributed.all_sum(y, group=self.group)
            embeds = embeds + y
        return rms_norm(embeds, self.eps)


class DiffusionGemma(nn.Module):
    """The text model: ``prefill`` (encoder pass) and ``denoise`` (decoder pass)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = FloatEmbedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_conditioning = SelfConditioning(args)
        self.rope_freqs = mx.ones((args.global_head_dim // 2,))
        self.embed_scale = math.sqrt(args.hidden_size)
        # The activation dtype of prefill/denoise when none is passed: float32 (exact); the
        # loader's runtime precision sets it (``mlx_dgemma.precision``). Not a parameter.
        self.activation_dtype = mx.float32
        # Tensor parallelism (``shard``): the group, and this rank's token ids [lo, hi).
        self.group: mx.distributed.Group | None = None
        self.vocab = (0, args.vocab_size)

    @property
    def ranks(self) -> int:
        """How many ranks share the model (1 unless :meth:`shard` split it)."""
        return 1 if self.group is None else self.group.size()

    def shard_plan(self, ranks: int, rank: int) -> dict[str, Split]:
        """Which slice of each sharded module rank ``rank`` of ``ranks`` keeps (module path ->
        :class:`Split`); modules not named are replicated. Used by :meth:`shard` and by the
        loader, which reads only these slices from disk."""
        a = self.args
        plan: dict[str, Split] = {"embed_tokens": Split("out", (vocab_range(a.vocab_size, ranks, rank),))}

        def mlp(prefix: str, hidden: int) -> None:
            lo, hi = even(hidden, ranks, rank, f"{prefix} hidden size")
            for name in ("gate_proj", "up_proj"):
                plan[f"{prefix}.{name}"] = Split("out", ((lo, hi),))
            plan[f"{prefix}.down_proj"] = Split("in", ((lo, hi),))

        mlp("self_conditioning", a.intermediate_size)
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            (q_lo, q_hi), (kv_lo, kv_hi) = att.head_splits(ranks, rank)
            d = att.head_dim
            p = f"layers.{i}"
            plan[f"{p}.self_attn.q_proj"] = Split("out", ((q_lo * d, q_hi * d),))
            plan[f"{p}.self_attn.k_proj"] = Split("out", ((kv_lo * d, kv_hi * d),))
            if att.sliding:
                plan[f"{p}.self_attn.v_proj"] = Split("out", ((kv_lo * d, kv_hi * d),))
            plan[f"{p}.self_attn.o_proj"] = Split("in", ((q_lo * d, q_hi * d),))
            mlp(f"{p}.mlp", a.intermediate_size)
            I = a.moe_intermediate_size
            lo, hi = even(I, ranks, rank, "experts' hidden size")
            plan[f"{p}.experts.gate_up_proj"] = Split("out", ((lo, hi), (I + lo, I + hi)))  # gate rows, up rows
            plan[f"{p}.experts.down_proj"] = Split("in", ((lo, hi),))
        return plan

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's slice of every layer (tensor parallelism across ``group``).

        Attention heads, the dense MLPs' and every expert's hidden dimension, and the tied
        embedding's vocabulary are split; the router, norms and scalars are replicated. The
        parameters are sliced in place (an unloaded model's lazy ones cost nothing, so the
        loader shards first and then reads only the slices).
        """
        if self.group is not None:
            raise ParameterError("the model is already sharded; load it again to shard it differently")
        ranks, rank = group.size(), group.rank()
        plan = self.shard_plan(ranks, rank)
        modules = dict(self.named_modules())
        for path, split in plan.items():
            shard_module(modules[path], split)
        for layer in self.layers:
            att = layer.self_attn
            (q_lo, q_hi), (kv_lo, kv_hi) = att.head_splits(ranks, rank)
            att.n_heads, att.n_kv = q_hi - q_lo, kv_hi - kv_lo
            att.group = layer.group = group
            layer.experts.inter = self.args.moe_intermediate_size // ranks
        self.self_conditioning.group = group
        self.group = group
        self.vocab = plan["embed_tokens"].ranges[0]

    def global_freqs(self) -> mx.array:
        """RoPE wavelengths of the global layers: base^(2i/d) times llama.cpp's factors (1 =
        rotate, 1e30 = keep), as their attention takes them (``freqs``; sliding layers: None)."""
        d = self.args.global_head_dim
        base = float(self.args.rope_parameters["full_attention"]["rope_theta"])
        return (base ** (mx.arange(0, d, 2, dtype=mx.float32) / d)) * self.rope_freqs

    def embed(self, ids: mx.array, dtype: mx.Dtype) -> mx.array:
        if self.group is None:
            return self.embed_tokens(ids).astype(dtype) * mx.array(self.embed_scale, dtype=dtype)
        lo, hi = self.vocab  # each rank looks up its own ids; the others' rows are zeros
        mine = (ids >= lo) & (ids < hi)
        rows = mx.where(mine[..., None], self.embed_tokens(mx.where(mine, ids - lo, 0)), 0.0).astype(dtype)
        rows = mx.distributed.all_sum(rows, group=self.group)  # adds zeros: exact in any dtype
        return rows * mx.array(self.embed_scale, dtype=dtype)

    def make_cache(self) -> KVCache:
        return KVCache(self.args)

    def _layers(self, h: mx.array, cache: KVCache, encode: bool) -> mx.array:
        freqs = self.global_freqs()
        offset = cache.offset
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i], offset, encode, None if layer.self_attn.sliding else freqs)
        return h

    def prefill(self, ids: mx.array, cache: KVCache, dtype: mx.Dtype | None = None,
                chunk_size: int | None = DEFAULT_PREFILL_CHUNK) -> None:
        """Encoder pass: causal (windowed on sliding layers) over ``ids`` [B, P]; extends the cache.

        Runs in chunks of ``chunk_size`` tokens (``None``: one pass), see :meth:`prefill_chunks`.
        """
        for _ in self.prefill_chunks(ids, cache, dtype, chunk_size):
            pass

    def prefill_chunks(self, ids: mx.array, cache: KVCache, dtype: mx.Dtype | None = None,
                       chunk_size: int | None = DEFAULT_PREFILL_CHUNK) -> Iterator[int]:
        """The encoder pass in chunks; yields the tokens done after each evaluated chunk.

        Each chunk attends causally to the cache so far and to itself, so the result equals
        one pass over all of ``ids`` (to float32 rounding) while the working memory depends on
        the chunk, not the prompt. Stopping the iteration between chunks leaves a consistent
        cache holding the chunks done. ``dtype`` defaults to the model's ``activation_dtype``.
        """
        dtype = dtype or self.activation_dtype
        P = ids.shape[1]
        step = P if chunk_size is None else int(chunk_size)
        if step < 1:
            raise ParameterError(f"prefill chunk_size: {chunk_size}; expected a positive number of tokens (or None)")
        cache.reserve(int(cache.offset) + P)
        freqs = self.global_freqs()
        last = len(self.layers) - 1
        for start in range(0, P, step):
            chunk = ids[:, start:start + step]
            h = self.embed(chunk, dtype)
            offset = cache.offset
            for i, layer in enumerate(self.layers):
                f = None if layer.self_attn.sliding else freqs
                if i == last:  # only its keys and values are ever read: no attention, no MLP
                    layer.self_attn.write_cache(layer.input_layernorm(h), cache[i], offset, f)
                else:
                    h = layer(h, cache[i], offset, True, f)
            cache.advance(chunk.shape[1])
            mx.eval(cache.state())
            yield start + chunk.shape[1]

    def denoise(self, canvas: mx.array, cache: KVCache, self_conditioning_logits: mx.array | None = None,
                dtype: mx.Dtype | None = None, sc_top_k: int | None = None) -> mx.array:
        """Decoder pass over ``canvas`` [B, C]: logits [B, C, V] (float32, after the softcap).

        The canvas attends to the whole cache window and to itself, bidirectionally; its
        positions continue after the cached length. The cache is only read. ``sc_top_k``
        approximates self-conditioning with each position's k most likely tokens. ``dtype``
        defaults to the model's ``activation_dtype`` (set by the runtime precision).
        """
        dtype = dtype or self.activation_dtype
        h = self.embed(canvas, dtype)
        soft = None
        if self_conditioning_logits is not None:
            soft = self.soft_embeddings(self_conditioning_logits, dtype, sc_top_k)
        h = self.self_conditioning(h, soft)
        h = self._layers(h, cache, encode=False)
        return self.logits(self.norm(h))

    def soft_embeddings(self, logits: mx.array, dtype: mx.Dtype, top_k: int | None = None) -> mx.array:
        """softmax(logits) @ E * sqrt(hidden), from the quantized embedding directly."""
        if self.group is not None:
            return self._sharded_soft_embeddings(logits, dtype, top_k)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        if top_k is None:
            soft = self.embed_tokens.soft_lookup(probs.astype(dtype))
        else:
            idx = top_k_indices(probs, top_k)  # [B, C, k]
            p = mx.take_along_axis(probs, idx, axis=-1)
            p = p / p.sum(axis=-1, keepdims=True)
            rows = self.embed_tokens(idx).astype(dtype)  # [B, C, k, H]
            soft = (p.astype(dtype)[..., None] * rows).sum(axis=-2)
        return soft * mx.array(self.embed_scale, dtype=dtype)

    def _sharded_soft_embeddings(self, logits: mx.array, dtype: mx.Dtype, top_k: int | None) -> mx.array:
        """``soft_embeddings`` with the vocabulary split: ``logits`` are this rank's columns."""
        g, (lo, hi) = self.group, self.vocab
        x = logits.astype(mx.float32)
        m, s = global_softmax_stats(x, g)
        probs = mx.exp(x - m) / s  # this rank's columns of the global softmax
        if top_k is None:
            soft = mx.distributed.all_sum(self.embed_tokens.soft_lookup(probs.astype(dtype)), group=g)
            return soft * mx.array(self.embed_scale, dtype=dtype)
        k = min(top_k, self.args.vocab_size // g.size())  # the same on every rank (all_gather needs it)
        if k * g.size() < top_k:
            raise ParameterError(f"sc_top_k = {top_k}: at most {k * g.size()} with {g.size()} ranks")
        idx = top_k_indices(probs, k)  # [B, C, k] this rank's best
        p = mx.take_along_axis(probs, idx, axis=-1)
        cand_p = mx.distributed.all_gather(p[None], group=g)  # [R, B, C, k]
        cand_i = mx.distributed.all_gather((idx + lo)[None], group=g)
        cand_p = mx.moveaxis(cand_p, 0, -2).flatten(-2)  # [B, C, R*k]
        cand_i = mx.moveaxis(cand_i, 0, -2).flatten(-2)
        best = mx.argpartition(-cand_p, kth=top_k - 1, axis=-1)[..., :top_k]  # the global top k
        p = mx.take_along_axis(cand_p, best, axis=-1)
        ids = mx.take_along_axis(cand_i, best, axis=-1)
        p = p / p.sum(axis=-1, keepdims=True)
        mine = (ids >= lo) & (ids < hi)
        rows = self.embed_tokens(mx.where(mine, ids - lo, 0)).astype(dtype)  # [B, C, k, H]
        w = mx.where(mine, p, 0.0).astype(dtype)
        soft = mx.distributed.all_sum((w[..., None] * rows).sum(axis=-2), group=g)
        return soft * mx.array(self.embed_scale, dtype=dtype)

    def logits(self, h: mx.array) -> mx.array:
        """The output head after the softcap (a sharded model: its own vocabulary's columns)."""
        x = self.embed_tokens.as_linear(h).astype(mx.float32)
        cap = self.args.final_logit_softcapping
        return mx.tanh(x / cap) * cap
