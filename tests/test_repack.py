"""fast's lossless repack of 5-bit legacy weights (Q5_0, Q5_1) to 8-bit groups on a GPU (issue
33 item 3): the same dequantized values bit for bit, done under fast on a (simulated) GPU only,
counted in the memory plan, and left out, in one line, when only the 5-bit form fits."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma import load
from mlx_dgemma.loader import load_dir, plan_model
from mlx_dgemma.plan import make_plan
from mlx_dgemma.precision import resolve_precision
from mlx_dgemma.tiers import REPACK_TYPES, weight_bytes
from tests.test_tiers import HEADER, _published_inventory


def _published_args():
    from mlx_dgemma.convert.metadata import args_from_metadata

    return args_from_metadata(json.loads(HEADER.read_text())["metadata"], vocab_size=262144)


@pytest.fixture(scope="module")
def q5_paths(tiny_model_dir):
    quant = json.loads((tiny_model_dir / "config.json").read_text())["quantization"]
    paths = {p for p, v in quant.items() if isinstance(v, dict) and v.get("ggml_type") in REPACK_TYPES}
    assert any(".experts.down_proj" in p for p in paths), paths  # the tiny model has what the published one has
    return paths


def _modules(model, paths):
    return {p: m for p, m in model.named_modules() if p in paths}


def _logits(model) -> mx.array:
    cache = model.make_cache()
    model.prefill(mx.array([[5, 6, 7, 8, 9, 10, 11, 12]]), cache)
    canvas = mx.random.randint(0, model.args.vocab_size, (1, model.args.canvas_length), key=mx.random.key(3))
    return model.denoise(canvas, cache).astype(mx.float32)


def test_repack_keeps_every_value_and_the_outputs(tiny_model_dir, q5_paths, simulate_mac):
    # on the CPU backend fast keeps the 5-bit form; on a (simulated) GPU it repacks it to 8 bits
    plain = load(tiny_model_dir, precision="fast", dtype="float32")
    assert not plain.precision.repack
    simulate_mac("mac-32gb")
    packed = load(tiny_model_dir, precision="fast", dtype="float32")
    assert packed.precision.repack
    before, after = _modules(plain.model, q5_paths), _modules(packed.model, q5_paths)
    assert before.keys() == after.keys() == q5_paths
    for p in q5_paths:
        a, b = before[p], after[p]
        assert (a.bits, a.group_size) == (5, 32) and (b.bits, b.group_size) == (8, 32), p
        assert b["weight"].shape[-1] == a["weight"].shape[-1] * 8 // 5, p  # the whole row, one byte a weight
        assert mx.array_equal(a["scales"], b["scales"]) and mx.array_equal(a["biases"], b["biases"]), p
        # bit for bit: compared as integers, so -0.0 against 0.0 or a NaN would show too
        wa = mx.dequantize(a["weight"], a["scales"], a["biases"], group_size=32, bits=5)
        wb = mx.dequantize(b["weight"], b["scales"], b["biases"], group_size=32, bits=8)
        assert np.array_equal(np.asarray(wa).view(np.uint32), np.asarray(wb).view(np.uint32)), p
    # every other parameter untouched
    for (k, x), (_, y) in zip(tree_flatten(plain.model.parameters()), tree_flatten(packed.model.parameters())):
        if k.rpartition(".")[0] not in q5_paths:
            assert x.dtype == y.dtype and mx.array_equal(x, y), k
    # the same values through kernels of another bit width: equal up to float32 summation order
    la, lb = _logits(plain.model), _logits(packed.model)
    err = float(mx.abs(la - lb).max()) / float(mx.abs(la).max())
    assert err <= 1e-5, err


def test_repack_only_in_fast_and_only_on_a_gpu(tiny_model_dir, q5_paths, simulate_mac):
    assert not resolve_precision("fast").repack  # MLX's CPU backend (this machine)
    cpu = load(tiny_model_dir, precision="fast")
    assert {m.bits for m in _modules(cpu.model, q5_paths).values()} == {5}
    simulate_mac("mac-32gb")
    assert resolve_precision("fast").repack and resolve_precision("auto").repack
    assert not resolve_precision("q4").repack and not resolve_precision("exact").repack
    exact = load(tiny_model_dir, precision="exact")
    assert {m.bits for m in _modules(exact.model, q5_paths).values()} == {5}
    assert exact.precision.repack is False
    fast = load(tiny_model_dir, precision="auto", dtype="float32")
    assert fast.precision.name == "fast" and fast.precision.repack
    assert {m.bits for m in _modules(fast.model, q5_paths).values()} == {8}
    # apply_precision does what the precision says, whatever the device
    off, _ = load_dir(tiny_model_dir, replace(fast.precision, repack=False))
    assert {m.bits for m in _modules(off, q5_paths).values()} == {5}


def test_plan_counts_the_repack_at_full_size():
    inv, layers = _published_inventory()
    args = _published_args()
    gpu = make_plan("m", args, inv, "gguf", memory_limit=1 << 50, gpu=True)
    cpu = make_plan("m", args, inv, "gguf", memory_limit=1 << 50, gpu=False)
    plain = weight_bytes(inv, "fast", layers, scale_bytes=2, float_bytes=2)
    # independently: every Q5_0 weight 3 bits more (5 -> 8), scales and biases as they were
    q5 = sum(int(np.prod(t.shape)) for t in inv if t.ggml_type == "Q5_0")
    assert q5 == 4_161_191_936  # the 16 down-expert tensors, the dense down projections, self_cond_down
    row = gpu.row("fast")
    assert row.repacked is True and row.repack_bytes == q5 * 3 // 8
    assert row.weights_bytes == plain + q5 * 3 // 8 and row.load_peak_bytes >= row.weights_bytes
    assert row.repack_bytes / 1e9 == pytest.approx(1.56, abs=0.01)
    assert gpu.repack_note() is None
    assert any("repacked to 8 bits" in ln and "+1.56 GB" in ln for ln in gpu.table())  # `plan` says so
    assert not any("5-bit" in ln for ln in cpu.table())
    # the CPU backend, exact and the tiers: nothing repacked, nothing counted
    assert cpu.row("fast").repacked is None and cpu.row("fast").repack_bytes == 0
    assert gpu.row("exact").repacked is None and gpu.row("exact").weights_bytes == cpu.row("exact").weights_bytes
    for p in ("q4", "q3"):
        assert gpu.row(p).repacked is None and gpu.row(p).repack_bytes == 0
        assert gpu.row(p).weights_bytes == weight_bytes(inv, p, layers, scale_bytes=2, float_bytes=2)


def test_plan_falls_back_to_the_5bit_form_when_only_it_fits():
    inv, _ = _published_inventory()
    args = _published_args()
    roomy = make_plan("m", args, inv, "gguf", memory_limit=1 << 50, gpu=True).row("fast")
    between = roomy.needed_bytes - roomy.repack_bytes // 2  # the 5-bit form fits, the 8-bit one does not
    plan = make_plan("m", args, inv, "gguf", memory_limit=between, gpu=True)
    row = plan.row("fast")
    assert row.fits and row.repacked is False and row.repack_bytes == roomy.repack_bytes
    assert row.weights_bytes == roomy.weights_bytes - roomy.repack_bytes
    assert plan.choose("auto") == "fast"  # the repack never pushes auto to a lossier tier
    note = plan.repack_note()
    assert note is not None and "\n" not in note and "5-bit" in note and "1.56 GB" in note
    assert f"  {note}" in plan.table()


def test_no_repack_note_for_a_stored_form_that_cannot_load_fast():
    # `plan Q4_DIR` on a GPU Mac told how fast's 5-bit weights would be repacked, beside a fast row
    # it marks "-- (stored form is lossier)"
    inv, _ = _published_inventory()
    args = _published_args()
    plan = make_plan("m", args, inv, "q4", memory_limit=1 << 50, gpu=True)
    assert not plan.row("fast").loadable
    assert not any("5-bit" in ln or "repacked" in ln for ln in plan.table()), plan.table()


def test_the_repack_leaves_at_least_its_own_size_free():
    # a 32 GB Mac: the repacked form would fit with 0.74 GB to spare, less than the repack's 1.56:
    # it stays 5-bit there (the room is a longer conversation's), and repacks where room is ample
    inv, _ = _published_inventory()
    args = _published_args()
    roomy = make_plan("m", args, inv, "gguf", memory_limit=1 << 50, gpu=True).row("fast")
    just = make_plan("m", args, inv, "gguf", memory_limit=roomy.needed_bytes, gpu=True).row("fast")
    assert just.fits and just.repacked is False
    ample = make_plan("m", args, inv, "gguf", memory_limit=roomy.needed_bytes + roomy.repack_bytes, gpu=True)
    assert ample.row("fast").repacked is True


def test_load_without_the_repack_when_only_the_5bit_form_fits(tiny_model_dir, q5_paths, simulate_mac, caplog):
    simulate_mac("mac-32gb")
    roomy = plan_model(tiny_model_dir).row("fast")
    assert roomy.repacked is True and roomy.repack_bytes > 0
    limit = roomy.needed_bytes - roomy.repack_bytes // 2
    assert not plan_model(tiny_model_dir, memory_limit=limit).row("fast").repacked
    with caplog.at_level(logging.WARNING, logger="mlx_dgemma.loader"):
        rt = load(tiny_model_dir, precision="fast", dtype="float32", memory_limit=limit)
    assert rt.precision.name == "fast" and not rt.precision.repack
    assert {m.bits for m in _modules(rt.model, q5_paths).values()} == {5}
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_dgemma.loader"]
    assert len(lines) == 1 and "5-bit" in lines[0] and "\n" not in lines[0], lines
    # with room, no line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_dgemma.loader"):
        load(tiny_model_dir, precision="fast", dtype="float32", memory_limit=roomy.needed_bytes + roomy.repack_bytes)
    assert not [r for r in caplog.records if r.name == "mlx_dgemma.loader"]
