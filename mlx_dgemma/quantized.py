"""Quantized layers for weights repacked from GGUF, and the swap that installs them.

MLX's ``nn.QuantizedLinear``/``nn.QuantizedEmbedding`` and mlx-lm's ``QuantizedSwitchLinear``
do the work; the subclasses add one thing: *padded sub-blocks*. ggml types with 16-element
sub-blocks (Q2_K, Q3_K, Q6_K) are stored with each sub-block padded to a 32-element MLX
group (see ``mlx_dgemma.schema.pad_subblocks``). The stored matrix is twice as wide, and the input
gets zeros at the padding positions, so the product is exactly the original weight's.
Scales may be float32 (exact K-quant scales); outputs are cast back to the input dtype.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .schema import QuantSpec, pad_subblocks, unpad_subblocks
from .switch_layers import QuantizedSwitchLinear, SwitchLinear  # mlx-lm's, vendored


class GGUFQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` over a (possibly padded) repacked GGUF weight."""

    def __init__(self, input_dims: int, output_dims: int, bits: int, subblock: int = 32,
                 group_size: int = 32):
        stored = input_dims * (2 if subblock == 16 else 1)
        super().__init__(stored, output_dims, bias=False, group_size=group_size, bits=bits)
        self.subblock = subblock

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(pad_subblocks(x, self.subblock)).astype(x.dtype)


class GGUFQuantizedEmbedding(nn.QuantizedEmbedding):
    """Quantized token embedding, also used as the tied output head and for soft lookups."""

    def __init__(self, num_embeddings: int, dims: int, bits: int, subblock: int = 32,
                 group_size: int = 32):
        stored = dims * (2 if subblock == 16 else 1)
        super().__init__(num_embeddings, stored, group_size=group_size, bits=bits)
        self.subblock = subblock
        self.dims = dims

    def __call__(self, ids: mx.array) -> mx.array:
        # mx.dequantize computes in the scales' dtype: float16 scales (exact as stored) would
        # round the rows to float16, so the gathered scales are upcast first (cheap: [..., H/32]).
        s, b = self["scales"][ids], self["biases"][ids]
        if s.dtype != mx.float32:
            s, b = s.astype(mx.float32), b.astype(mx.float32)
        w = mx.dequantize(self["weight"][ids], s, b, group_size=self.group_size, bits=self.bits)
        return unpad_subblocks(w, self.subblock)

    def as_linear(self, x: mx.array) -> mx.array:
        """x @ E^T: the tied output head."""
        return super().as_linear(pad_subblocks(x, self.subblock)).astype(x.dtype)

    def soft_lookup(self, probs: mx.array) -> mx.array:
        """probs @ E straight from the quantized matrix (no dense copy of the embedding)."""
        out = mx.quantized_matmul(probs, self["weight"], self["scales"], self.get("biases"),
                                  transpose=False, group_size=self.group_size, bits=self.bits)
        return unpad_subblocks(out, self.subblock).astype(probs.dtype)


class FloatEmbedding(nn.Embedding):
    """Unquantized embedding with the same interface as :class:`GGUFQuantizedEmbedding`."""

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight.astype(x.dtype).T

    def soft_lookup(self, probs: mx.array) -> mx.array:
        return probs @ self.weight.astype(probs.dtype)


class GGUFQuantizedSwitchLinear(QuantizedSwitchLinear):
    """Stacked quantized experts ([E, out, in], contiguous per expert) for ``gather_qmm``."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bits: int,
                 subblock: int = 32, group_size: int = 32):
        stored = input_dims * (2 if subblock == 16 else 1)
        super().__init__(stored, output_dims, num_experts, bias=False, group_size=group_size, bits=bits)
        self.subblock = subblock

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return super().__call__(pad_subblocks(x, self.subblock), indices,
                                sorted_indices=sorted_indices).astype(x.dtype)


def _quantized_like(module: nn.Module, spec: QuantSpec) -> nn.Module:
    bits, sub, gs = spec.bits, spec.subblock, spec.group_size
    if isinstance(module, nn.Embedding):
        n, d = module.weight.shape
        return GGUFQuantizedEmbedding(n, d, bits, sub, gs)
    if isinstance(module, SwitchLinear):
        e, o, i = module.weight.shape
        return GGUFQuantizedSwitchLinear(i, o, e, bits, sub, gs)
    if isinstance(module, nn.Linear):
        o, i = module.weight.shape
        return GGUFQuantizedLinear(i, o, bits, sub, gs)
    raise TypeError(f"cannot quantize {type(module).__name__}")


def quantize_modules(model: nn.Module, quantization: dict[str, Any]) -> None:
    """Replace each module named in ``quantization`` (config.json) by its quantized form."""
    specs = {k: QuantSpec.from_dict(v) for k, v in quantization.items() if isinstance(v, dict)}
    replacements = []
    for path, module in model.named_modules():
        if path in specs:
            replacements.append((path, _quantized_like(module, specs[path])))
    missing = set(specs) - {p for p, _ in replacements}
    if missing:
        raise KeyError(f"quantization config names modules the model does not have: {sorted(missing)[:5]}")
    model.update_modules(_tree(replacements))


def _tree(items: list[tuple[str, nn.Module]]) -> dict:
    """[('layers.0.mlp.up_proj', m)] -> nested dict/list tree for ``update_modules``."""
    root: dict = {}
    for path, m in items:
        node = root
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = m
    return _lists(root)


def _lists(node):
    if isinstance(node, nn.Module) or not isinstance(node, dict):  # a Module is a dict too
        return node
    if node and all(k.isdigit() for k in node):
        n = max(int(k) for k in node) + 1
        return [_lists(node.get(str(i), {})) for i in range(n)]
    return {k: _lists(v) for k, v in node.items()}
