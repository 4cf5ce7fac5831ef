"""Tensor parallelism (mlx_dgemma/distributed.py, DiffusionGemma.shard): two local ranks under
``mlx.launch --backend ring`` reproduce one process, and each rank's slices are the right ones.

Tolerance: the sharded model computes the same float32 math, but every all-reduce changes the
summation order of a dot product (two half sums added instead of one long sum) and the softmax
normalisers are summed per rank. That is the rounding that separates two float32
implementations of the same model, so the bound is the parity tests' one against transformers,
1e-5 of the largest logit (measured here: about 7e-7 on the trained demo).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_flatten

from mlx_dgemma import distributed, generate, load
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.demo import load_demo, trained_demo_path
from mlx_dgemma.distributed import Split, load_shards, param_slices, take
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import build_model
from mlx_dgemma.validate import check_model_dir, model_dir_shards

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker  # noqa: E402

TOL = 1e-5
# `mlx.launch` (MLX's console script) with this interpreter, wherever the script was installed
LAUNCH = [sys.executable, "-c", "import sys; from importlib.metadata import entry_points; "
          "sys.exit(entry_points(group='console_scripts')['mlx.launch'].load()())",
          "-n", "2", "--backend", "ring", "--"]

needs_ring = pytest.mark.skipif(not mx.distributed.is_available(), reason="this MLX build has no distributed backend")


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def launch(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    # mlx.launch exits 0 even when a rank fails: callers check the ranks' output
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "demo"
    convert(trained_demo_path(), out)
    return out


@needs_ring
def test_two_ranks_reproduce_one_process(demo_dir, tmp_path):
    """Per-rank loading from a converted directory, a 4-chunk prefill, logits with exact and
    top-k self-conditioning, and a seeded generation: 2 ranks against one process."""
    out = tmp_path / "ranks.npz"
    r = launch([sys.executable, distributed_worker.__file__, str(demo_dir), str(out)])
    assert out.is_file(), r.stdout + r.stderr
    got, meta = np.load(out), json.loads(Path(str(out) + ".json").read_text())
    ref = distributed_worker.run(str(demo_dir))
    assert meta["ranks"] == 2 and ref["ranks"] == 1 and meta["chunks"] == ref["chunks"] >= 3
    for name in ("first", "sc", "sc_top_k"):
        assert got[name].shape == ref[name].shape
        assert rel(got[name], ref[name]) <= TOL, name
    assert meta["text"] == ref["text"] and len(ref["text"]) > 20


@needs_ring
def test_generate_cli_under_mlx_launch():
    """`mlx.launch -n 2 -- python -m mlx_dgemma generate --demo --json`: one JSON line (rank 0
    alone prints), "ranks": 2, and the text of one process with the same seed."""
    args = ["--prompt", "In the beginning", "--seed", "0", "--steps", "8", "--max-tokens", "64"]
    r = launch([sys.executable, "-m", "mlx_dgemma", "generate", "--demo", "--json", *args])
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout + r.stderr
    res = json.loads(lines[0])
    assert res["ranks"] == 2
    model, tok = load_demo()
    assert res["text"] == generate(model, tok, "In the beginning", seed=0, max_denoising_steps=8, max_new_tokens=64)


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_refuse_several_ranks(command, monkeypatch, capsys):
    """One line naming the command and what to use instead, before any loading (the group is
    stubbed: starting one needs mlx.launch; the launch tests above cover a real one)."""
    from mlx_dgemma.cli import main

    class TwoRanks:
        def size(self) -> int:
            return 2

    monkeypatch.setattr(distributed, "world", lambda: TwoRanks())
    monkeypatch.setenv("MLX_RANK", "0")  # what mlx.launch sets: the command line looks for a group only then
    assert main([command, "--demo"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs in one process" in err[0] and "generate" in err[0], err


def _unloaded(model_dir: Path):
    return build_model(check_model_dir(model_dir))


def _full_shapes(model) -> dict:
    full = {p: {k: tuple(v.shape) for k, v in m.parameters().items() if isinstance(v, mx.array)}
            for p, m in model.named_modules()}
    return {p: s for p, s in full.items() if s}


def test_rank_slices_read_from_disk_are_the_full_tensors_slices(all_types_model_dir):
    """Every ggml type (padded 16-element sub-blocks included): what a rank reads from the files
    equals slicing the fully loaded tensor, and the two ranks' parts cover it."""
    full_model, _ = load(all_types_model_dir, precision="exact")
    full = dict(tree_flatten(full_model.parameters()))
    files = model_dir_shards(all_types_model_dir)
    parts = []
    for rank in range(2):
        model = _unloaded(all_types_model_dir)
        shapes = _full_shapes(model)
        plan = model.shard_plan(2, rank)
        weights = dict(load_shards(model, files, shapes, plan))
        assert set(weights) == set(full)
        modules = dict(model.named_modules())
        for path, split in plan.items():
            for pname, (axis, ranges) in param_slices(modules[path], split, shapes[path]).items():
                name = f"{path}.{pname}"
                assert mx.array_equal(weights[name], take(full[name], axis, ranges)).item(), name
        parts.append(weights)
    q = "layers.0.self_attn.q_proj.weight"
    assert parts[0][q].shape[0] + parts[1][q].shape[0] == full[q].shape[0]
    assert not mx.array_equal(parts[0][q], parts[1][q]).item()


def test_padded_input_split_sums_to_the_full_product(all_types_model_dir):
    """A quantized layer split along its input (o_proj, down_proj) with padded 16-element
    sub-blocks: the two ranks' partial products add up to the whole layer's output."""
    model, _ = load(all_types_model_dir, precision="exact")
    padded = [(p, m) for p, m in model.named_modules()
              if getattr(m, "subblock", 32) == 16 and p.endswith(("o_proj", "down_proj")) and "experts" not in p]
    assert padded, "the all-types model has no padded input-split layer"
    path, m = padded[0]
    n_in = m.weight.shape[-1] * 32 // m.bits // 2
    x = mx.random.normal((3, n_in), key=mx.random.key(1))
    whole = m(x)
    total = mx.zeros_like(whole)
    for rank in range(2):
        lo, hi = distributed.even(n_in, 2, rank, "features")
        part = type(m)(hi - lo, m.weight.shape[0], m.bits, m.subblock, m.group_size)
        shapes = {k: tuple(v.shape) for k, v in m.parameters().items()}
        for name, (axis, ranges) in param_slices(m, Split("in", ((lo, hi),)), shapes).items():
            setattr(part, name, take(m[name], axis, ranges))
        total = total + part(x[:, lo:hi])
    assert rel(np.array(total), np.array(whole)) <= TOL


def test_split_that_cuts_heads_or_groups_is_refused(tiny_model_dir):
    model = _unloaded(tiny_model_dir)  # 2 query heads
    with pytest.raises(ParameterError, match="ranks"):
        model.shard_plan(3, 0)
    m = model.layers[0].self_attn.o_proj
    shapes = {k: tuple(v.shape) for k, v in m.parameters().items()}
    with pytest.raises(ParameterError, match="quantization group"):
        param_slices(m, Split("in", ((0, 8),)), shapes)
