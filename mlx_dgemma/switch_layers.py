# Copyright © 2023 Apple Inc.
#
# Vendored from mlx-lm 0.32.2, mlx_lm/models/switch_layers.py (https://github.com/ml-explore/mlx-lm),
# under its MIT License:
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
"""Stacked experts for ``gather_mm``/``gather_qmm``: mlx-lm's ``SwitchLinear`` and
``QuantizedSwitchLinear`` and its token sort helpers, vendored.

Importing ``mlx_lm.models.switch_layers`` runs ``mlx_lm/__init__``, which imports mlx-lm's
loader, converter and tokenizer utilities and through them transformers (and torch where it is
installed): 4-6 s on a Mac, 13 s on a loaded 2-core Linux box, before the first line of a
command or the chat app's first frame. The layers themselves are a few lines of MLX. Copied
unchanged in what they compute (``tests/test_switch_layers.py`` holds them to mlx-lm's, bit for
bit) but for type hints and docstrings, and only what this package uses: the quantized layer's
affine mode (the one GGUF's repacked weights use; mlx-lm's ``mxfp4``/``nvfp4`` modes and global
scales need newer MLX releases than this package requires) and no ``to_quantized`` (weights are
quantized as converted, by ``mlx_dgemma.quantized.quantize_modules``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows of ``x`` repeated per chosen expert and sorted by expert id, the sorted ids, and the
    permutation that undoes the sort (:func:`scatter_unsort`). mlx-lm's ``_gather_sort``."""
    *_, M = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], indices[order], inv_order


def scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple[int, ...] | None = None) -> mx.array:
    """Undo :func:`gather_sort`: back to token order, unflattened to ``shape`` along axis 0.
    mlx-lm's ``_scatter_unsort``."""
    x = x[inv_order]
    if shape is not None:
        x = mx.unflatten(x, 0, shape)
    return x


class QuantizedSwitchLinear(nn.Module):
    """``num_experts`` affine-quantized linear layers [E, out, in]; each row of ``x`` goes
    through the experts ``indices`` names (``gather_qmm``)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = True,
                 group_size: int = 64, bits: int = 4):
        super().__init__()
        self.group_size = group_size
        self.bits = bits
        scale = math.sqrt(1 / input_dims)
        weight = mx.random.uniform(low=-scale, high=scale, shape=(num_experts, output_dims, input_dims))
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        # Freeze this model's parameters
        self.freeze()

    @property
    def input_dims(self) -> int:
        return self.scales.shape[2] * self.group_size

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
                          transpose=True, group_size=self.group_size, bits=self.bits,
                          sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x


class SwitchLinear(nn.Module):
    """``num_experts`` linear layers [E, out, in]; each row of ``x`` goes through the experts
    ``indices`` names (``gather_mm``)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = True):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale, shape=(num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def input_dims(self) -> int:
        return self.weight.shape[2]

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x

