"""The experts' layers vendored from mlx-lm (``mlx_dgemma.switch_layers``) compute what mlx-lm's
do, bit for bit, and the model path imports neither mlx-lm's package nor transformers nor torch
(issue 30, item 4: 4-6 s on a Mac before the chat app's first frame)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma import switch_layers as ours

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("mlx_lm", "transformers", "torch")


def _theirs():
    # mlx-lm's own module: importing it runs mlx_lm/__init__ (transformers, torch), fine in a test
    return pytest.importorskip("mlx_lm.models.switch_layers")


def _same_parameters(a, b) -> None:
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert {k: v.shape for k, v in pa.items()} == {k: v.shape for k, v in pb.items()}
    assert {k: v.dtype for k, v in pa.items()} == {k: v.dtype for k, v in pb.items()}
    assert sorted(k for k, _ in tree_flatten(a.trainable_parameters())) == \
        sorted(k for k, _ in tree_flatten(b.trainable_parameters()))


def _inputs(tokens: int, top_k: int, experts: int, dims: int, seed: int):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((tokens, 1, 1, dims)).astype(np.float32))
    idx = mx.array(rng.integers(0, experts, (tokens, top_k)).astype(np.uint32))
    return x, idx


def _both_ways(layer, x, idx) -> list[np.ndarray]:
    """Unsorted, and sorted by expert as the model does above its threshold (then unsorted back)."""
    plain = layer(x, idx)
    xs, ids, inv = ours.gather_sort(x, idx)
    sorted_ = ours.scatter_unsort(layer(xs, ids, sorted_indices=True), inv, idx.shape)
    return [np.array(plain), np.array(sorted_)]


@pytest.mark.parametrize("bias", [False, True])
def test_switch_linear_computes_what_mlx_lms_does(bias):
    theirs = _theirs()
    E, I, O = 8, 64, 48
    ref = theirs.SwitchLinear(I, O, E, bias=bias)
    mine = ours.SwitchLinear(I, O, E, bias=bias)
    _same_parameters(mine, ref)
    mx.random.seed(3)
    weights = [("weight", mx.random.normal((E, O, I)))] + ([("bias", mx.random.normal((E, O)))] if bias else [])
    ref.load_weights(weights)
    mine.load_weights(weights)
    x, idx = _inputs(40, 4, E, I, seed=0)
    for a, b in zip(_both_ways(mine, x, idx), _both_ways(ref, x, idx)):
        np.testing.assert_array_equal(a, b)
    assert (mine.input_dims, mine.output_dims, mine.num_experts) == (ref.input_dims, ref.output_dims, ref.num_experts)


@pytest.mark.parametrize("bits, group_size", [(2, 32), (3, 32), (4, 32), (4, 64), (5, 64), (6, 32), (8, 32), (8, 64)])
def test_quantized_switch_linear_computes_what_mlx_lms_does(bits, group_size):
    theirs = _theirs()
    E, I, O = 8, 128, 32
    ref = theirs.QuantizedSwitchLinear(I, O, E, bias=False, group_size=group_size, bits=bits)
    mine = ours.QuantizedSwitchLinear(I, O, E, bias=False, group_size=group_size, bits=bits)
    _same_parameters(mine, ref)
    assert not tree_flatten(mine.trainable_parameters())  # frozen, as mlx-lm's
    mx.random.seed(bits * 100 + group_size)
    w, s, b = mx.quantize(mx.random.normal((E, O, I)), group_size, bits)
    ref.load_weights([("weight", w), ("scales", s), ("biases", b)])
    mine.load_weights([("weight", w), ("scales", s), ("biases", b)])
    x, idx = _inputs(40, 4, E, I, seed=bits)
    for a, b_ in zip(_both_ways(mine, x, idx), _both_ways(ref, x, idx)):
        np.testing.assert_array_equal(a, b_)
    assert (mine.input_dims, mine.output_dims, mine.num_experts) == (ref.input_dims, ref.output_dims, ref.num_experts)


def test_the_sort_helpers_are_mlx_lms():
    theirs = _theirs()
    x, idx = _inputs(33, 8, 16, 8, seed=5)
    a, b = ours.gather_sort(x, idx), theirs._gather_sort(x, idx)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.array(u), np.array(v))
    np.testing.assert_array_equal(np.array(ours.scatter_unsort(a[0], a[2], idx.shape)),
                                  np.array(theirs._scatter_unsort(b[0], b[2], idx.shape)))


def _modules_after(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return set(r.stdout.strip().splitlines()[-1].split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_the_model_path_imports_neither_mlx_lm_nor_transformers_nor_torch():
    # the loader, the model, generation, the worker and the chat app's engine: what every
    # command that runs a model imports before its first line of output
    mods = _modules_after("import mlx_dgemma.loader, mlx_dgemma.model, mlx_dgemma.generation, mlx_dgemma.worker, "
                          "mlx_dgemma.quantized, mlx_dgemma.precision, mlx_dgemma.runtime, mlx_dgemma.step, "
                          "mlx_dgemma.tui.engine, mlx_dgemma.tui.app")
    assert "mlx_dgemma.model" in mods  # the check sees what was imported
    assert _heavy(mods) == []


def test_generate_demo_loads_and_answers_without_them():
    # `generate --demo` in one process, load and answer: still none of them afterwards
    mods = _modules_after("from mlx_dgemma.cli import main\n"
                          "assert main(['generate', '--demo', '--prompt', 'Hi', '--seed', '0', '--steps', '2', "
                          "'--max-tokens', '64', '--json']) == 0")
    assert "mlx_dgemma.generation" in mods
    assert _heavy(mods) == []
