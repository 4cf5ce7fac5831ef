"""The memory plan under several ranks (mlx.launch): each rank is priced for its own share
(sharded tensors cut to their slices, replicated ones whole, its key/value heads' cache), and
``--precision auto`` ends with the same precision on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma.cache import DEFAULT_BUCKET
from mlx_dgemma.cli import main
from mlx_dgemma.demo import demo_file
from mlx_dgemma.loader import model_inventory, plan_model
from mlx_dgemma.model import DiffusionGemma
from mlx_dgemma.plan import DEFAULT_CONTEXT, make_plan, rank_args, rank_inventory
from mlx_dgemma.tiers import TIERS, TensorInfo, tensor_bytes

sys.path.insert(0, str(Path(__file__).parent))
import rankplan_worker  # noqa: E402
from test_distributed import LAUNCH, needs_ring  # noqa: E402
from test_tiers import HEADER, _published_inventory  # noqa: E402


class Group:
    """What ``DiffusionGemma.shard`` asks of a group: its size and this rank."""

    def __init__(self, n: int, r: int) -> None:
        self.n, self.r = n, r

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def published():
    from mlx_dgemma.convert.metadata import args_from_metadata

    inv, _ = _published_inventory()
    return args_from_metadata(json.loads(HEADER.read_text())["metadata"], vocab_size=262144), inv


def demo():
    args, inv, _ = model_inventory(demo_file("trained"))
    return args, inv


def sharded(args, ranks: int, rank: int) -> tuple[DiffusionGemma, dict[str, tuple[int, ...]]]:
    """The model as ``shard`` leaves it on that rank, and its parameters' shapes (lazy arrays
    sliced by ``take``: nothing is allocated)."""
    model = DiffusionGemma(args)
    model.shard(Group(ranks, rank))
    return model, {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("which", [published, demo])
def test_rank_share_is_the_sharded_models_slices(which):
    """Each rank's priced weights: the sum over the tensors of a 2-rank split as the sharded
    model holds them (shapes of the really sliced parameters, not the plan's arithmetic);
    the sharded parts about half, the replicated ones whole."""
    args, inv = which()
    layers = args.num_hidden_layers
    full = make_plan("m", args, inv, "exact", memory_limit=1 << 50, gpu=False)
    plans = [make_plan("m", args, inv, "exact", memory_limit=1 << 50, gpu=False, ranks=2, rank=r) for r in (0, 1)]
    for rank, plan in enumerate(plans):
        model, shapes = sharded(args, 2, rank)
        share = [TensorInfo(t.module, shapes.get(t.module) or shapes[f"{t.module}.weight"], t.ggml_type) for t in inv]
        assert rank_inventory(inv, DiffusionGemma(args).shard_plan(2, rank)) == share
        split = [(s, t) for s, t in zip(share, inv) if s.shape != t.shape]
        kept = [t for s, t in zip(share, inv) if s.shape == t.shape]
        assert split and kept
        assert {t.module.split(".")[-1] for _, t in split} >= {"embed_tokens", "q_proj", "gate_up_proj", "down_proj"}
        assert not any("router" in t.module or "norm" in t.module for _, t in split)
        for p in TIERS:
            kw = {} if p == "exact" else {"scale_bytes": 4, "float_bytes": 4}
            independent = sum(tensor_bytes(s, p, layers, **kw) for s in share)
            assert plan.row(p).weights_bytes == independent, p
            halves = sum(tensor_bytes(s, p, layers, **kw) for s, _ in split)
            whole = sum(tensor_bytes(t, p, layers, **kw) for _, t in split)
            # q4/q3 re-quantize each rank's slice: a half row may take a smaller group (the
            # published 704-wide down projections: 352 = 11 groups of 32, not of 64): more scales
            assert halves == pytest.approx(whole / 2, rel=2e-3 if p in ("exact", "fast") else 0.05), p
            replicated = sum(tensor_bytes(t, p, layers, **kw) for t in kept)
            assert plan.row(p).weights_bytes == halves + replicated
            assert replicated < 0.05 * whole
        # KV cache: this rank's key/value heads (a head shared by the ranks' query heads is
        # repeated on each), from the sharded attention layers themselves
        positions = -(-DEFAULT_CONTEXT // DEFAULT_BUCKET) * DEFAULT_BUCKET
        kv = sum((args.sliding_window - 1 if layer.self_attn.sliding else positions)
                 * (2 * layer.self_attn.n_kv * layer.self_attn.head_dim * 4 + 4) for layer in model.layers)
        assert plan.row("exact").kv_bytes == kv
    # the two ranks together hold every sharded element once
    a, b = (rank_inventory(inv, DiffusionGemma(args).shard_plan(2, r)) for r in (0, 1))
    assert sum(int(np.prod(x.shape)) + int(np.prod(y.shape)) for x, y in zip(a, b)) == sum(
        int(np.prod(t.shape)) * (1 if sa.shape != t.shape else 2) for sa, t in zip(a, inv))


def test_published_model_per_rank_kv_is_half():
    """The published model's key/value heads (8 sliding, 2 global) divide over 2 ranks: each
    rank's cache is half (but the slot positions, which every rank keeps)."""
    args, inv = published()
    one = make_plan("m", args, inv, "exact", memory_limit=1 << 50, gpu=True)
    two = make_plan("m", args, inv, "exact", memory_limit=1 << 50, gpu=True, ranks=2, rank=1)
    assert two.row("fast").kv_bytes == pytest.approx(one.row("fast").kv_bytes / 2, rel=5e-3)
    assert two.row("fast").kv_bytes > one.row("fast").kv_bytes / 2


def test_forms_quantized_before_the_split_are_refused_when_it_cuts_their_groups(capsys):
    """q4 made whole (a .gguf's, or a q4 directory's stored form) is cut by the 2-rank split
    (the published experts' 704-wide rows in groups of 64; the demo's 128-wide in 128): refused
    in the plan with one line, never offered by auto. Re-quantized after the split (from an
    exact or fast directory) it is loadable."""
    args, inv = published()
    for stored, refused in (("gguf", {"q4", "q3"}), ("q4", {"q4", "q3"}), ("exact", set()), ("fast", set())):
        plan = make_plan("m", args, inv, stored, memory_limit=1 << 50, gpu=True, ranks=2, rank=0)
        assert {r.precision for r in plan.rows if r.split_refused} == refused, stored
        one = make_plan("m", args, inv, stored, memory_limit=1 << 50, gpu=True)
        assert not any(r.split_refused for r in one.rows)
    plan = make_plan("m", args, inv, "q4", memory_limit=1 << 50, gpu=True, ranks=2, rank=0)
    from mlx_dgemma.errors import ParameterError

    for requested in ("auto", "q4"):
        with pytest.raises(ParameterError, match="do not split over 2 ranks; give the ranks a directory converted"):
            plan.choose(requested)
    gguf = str(demo_file("trained"))
    assert main(["plan", gguf, "--ranks", "2"]) == 0
    assert "-- (its groups do not split over 2 ranks)" in capsys.readouterr().out
    assert plan_model(gguf, ranks=2, rank=0).choose("auto") == "fast"


def test_plan_ranks_flag_prices_one_rank(capsys):
    gguf = demo_file("trained")
    assert main(["plan", str(gguf), "--ranks", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    one = plan_model(gguf).to_dict()
    assert two["ranks"] == 2 and one["ranks"] == 1
    for a, b in zip(two["precisions"], one["precisions"]):
        assert a["weights_bytes"] < 0.6 * b["weights_bytes"]
    assert main(["plan", str(gguf), "--ranks", "2"]) == 0
    assert "share of 2 ranks" in capsys.readouterr().out
    for bad in ("0", "3"):  # 3 ranks do not divide the demo's heads
        assert main(["plan", str(gguf), "--ranks", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "rank" in err[0], err


def _launch(budgets: tuple[int, int], args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + [sys.executable, rankplan_worker.__file__, *map(str, budgets), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    from mlx_dgemma.convert.converter import convert

    out = tmp_path_factory.mktemp("rankplan") / "demo"
    convert(demo_file("trained"), out)
    return out


@needs_ring
def test_auto_agrees_on_the_precision_every_rank_holds(demo_dir):
    """Two Macs of different memory: rank 0 holds `fast`, rank 1 only `q4`. Both load q4 and
    the generation runs (before, rank 0 loaded fast and rank 1 q4: collectives of different
    arrays). Then rank 1 holds nothing: every rank stops with one line, rank 0's naming rank 1
    and its figures."""
    # a converted directory: each rank re-quantizes its own slices (a .gguf's q4 is made
    # whole, before the split, and its groups of 128 do not split over 2 ranks of the demo)
    model = str(demo_dir)
    mine = plan_model(model, ranks=2, rank=1, memory_limit=1 << 50)
    small = (mine.row("fast").needed_bytes + mine.row("q4").needed_bytes) // 2
    cmd = ["generate", "--model", model, "--prompt", "And God said", "--max-tokens", "8", "--steps", "2",
           "--seed", "0", "--json"]
    r = _launch((1 << 40, small), cmd)
    assert r.stdout.strip(), r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["precision"].startswith("q4") and out["ranks"] == 2, (out, r.stderr)

    r = _launch((1 << 40, 1000), cmd)
    errors = sorted(ln for ln in r.stderr.splitlines() if "error:" in ln)
    assert len(errors) == 2 and "Traceback" not in r.stderr, r.stderr
    rank0 = next(e for e in errors if not e.startswith("[rank"))
    assert rank0.startswith("mlx-dgemma generate: error: rank 1: ") and "on rank 1 of 2 (its share)" in rank0, rank0
    assert "1 KB is available (rank 1's simulated Mac)" in rank0 or "is available (rank 1's simulated Mac)" in rank0


def test_a_sharded_runtime_prices_its_prompts_at_its_share():
    """Generation's memory check of a prompt on a sharded model prices this rank's share (the
    plan's: its heads and widths), not the whole model (which refused long prompts the rank
    holds). On the demo the one global key/value head is on both ranks, so the cache is not
    half; the attention's working memory is (4 heads -> 2)."""
    from dataclasses import replace

    from mlx_dgemma import load_demo
    from mlx_dgemma.memory import estimate

    rt = load_demo(precision="exact")
    assert rt.rank_args is rt.model.args  # one process: the model's own shapes
    whole = estimate(rt.rank_args, 2000)
    rt.model.shard(Group(2, 1))
    sharded_rt = replace(rt)  # as the loader builds it: the Runtime of a model already sharded
    share = estimate(sharded_rt.rank_args, 2000)
    assert sharded_rt.rank_args == rank_args(rt.model.args, 2, 1)[0]
    assert share.kv_bytes < whole.kv_bytes and share.prefill_working_bytes < 0.7 * whole.prefill_working_bytes
