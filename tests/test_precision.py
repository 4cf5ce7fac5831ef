"""Runtime precision: exact stays bit-exact, fast is really fast-shaped (no float32 scales, no
padded sub-blocks, no float32 quantized matmul in the compiled step) and stays within the
measured error of exact."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dgemma import load
from mlx_dgemma.bench import isolated, logit_agreement
from mlx_dgemma.cli import main
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import load_dir
from mlx_dgemma.precision import Precision, quantized_dtype_report, resolve_precision
from mlx_dgemma.sampler import SamplerParams

# fast vs exact on the tiny random Q4_K_M model (3 layers, canvas 32), measured with
# logit_agreement: max |err| / max |logit| at step 1 / with self-conditioning, and top-1
# agreement. Almost all of the error is the re-quantized Q6_K embedding (the output head):
# the synthetic Q6_K blocks have uniformly random sub-block scales, so the two 16-element
# sub-blocks that share an 8-bit group of 32 differ far more than in real files (real Q6_K
# data: see test_real_q6k_blocks_requantize_within_the_formats_step), and random weights amplify it.
# float32 fast (the CPU default): 0.034 / 0.036, top-1 32/32 / 32/32 (with min-max and refits
# before fast's pairs rule: 0.136 / 0.027, 32/32 / 32/32); bfloat16 fast (the GPU default) adds
# bfloat16 rounding: 0.40 / 0.33, 32/32 / 31/32 (before: 0.27 / 0.41, 31/32 / 31/32). A layout
# mistake gives errors above 1 and top-1 near 0.
BOUNDS = {"float32": (0.6, 0.9), "bfloat16": (0.8, 0.9)}


@pytest.fixture(scope="module")
def exact(tiny_model_dir):
    return load(tiny_model_dir, precision="exact").model


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def fast(request, tiny_model_dir):
    return load(tiny_model_dir, precision="fast", dtype=request.param).model


def test_resolve_precision():
    assert resolve_precision("exact") == Precision("exact", mx.float32)
    assert resolve_precision("fast", "bfloat16") == Precision("fast", mx.bfloat16, 64)  # top-64 self-conditioning
    # auto is fast, with the device's fast dtype (float32 on the CPU backend)
    auto = resolve_precision("auto")
    assert auto.name == "fast"
    assert auto.dtype == (mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
    with pytest.raises(ParameterError, match="--dtype"):
        resolve_precision("exact", "bfloat16")
    with pytest.raises(ParameterError, match="--precision"):
        resolve_precision("quick")


def test_exact_keeps_the_stored_form(tiny_model_dir, exact):
    report = quantized_dtype_report(exact)
    assert {sub for *_, sub in report} == {16, 32}  # Q6_K stays padded
    assert "float32" in {s for _, s, _, _ in report}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    for path, dt, bits, sub in report:
        spec = config["quantization"][path]
        assert (bits, sub, dt) == (spec["bits"], spec.get("subblock", 32), spec["scale_dtype"]), path
    same, _ = load_dir(tiny_model_dir)  # the loader's default is exact too
    for (k, a), (_, b) in zip(tree_flatten(exact.parameters()), tree_flatten(same.parameters())):
        assert a.dtype == b.dtype and mx.array_equal(a, b), k


def test_fast_has_one_dtype_and_no_padding(fast):
    dt = fast.activation_dtype
    name = str(dt).split(".")[-1]
    report = quantized_dtype_report(fast)
    assert report
    for path, scales, bits, sub in report:
        assert scales == name, f"{path}: scales {scales}, activations {name}"
        assert sub == 32, f"{path}: padded sub-blocks left in fast mode"
    for k, a in tree_flatten(fast.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            assert a.dtype == dt, k


def _record_quantized_matmuls(monkeypatch) -> list[tuple[str, mx.Dtype, mx.Dtype]]:
    calls: list[tuple[str, mx.Dtype, mx.Dtype]] = []
    for fn in ("quantized_matmul", "gather_qmm"):
        orig = getattr(mx, fn)

        def spy(x, w, scales, *a, _orig=orig, _fn=fn, **kw):
            calls.append((_fn, x.dtype, scales.dtype))
            return _orig(x, w, scales, *a, **kw)

        monkeypatch.setattr(mx, fn, spy)
    return calls


@pytest.mark.parametrize("built", ["runtime", "direct"])
def test_compiled_fast_step_has_no_float32_quantized_matmul(tiny_model_dir, monkeypatch, built):
    from mlx_dgemma.step import StepFunction

    rt = load(tiny_model_dir, precision="fast", dtype="bfloat16")
    model = rt.model
    calls = _record_quantized_matmuls(monkeypatch)
    C, V = model.args.canvas_length, model.args.vocab_size
    cache = model.make_cache()
    model.prefill(mx.array([[5, 6, 7, 8]]), cache)
    # compiled, in the precision's bfloat16: the runtime's step, or one built with no dtype given
    # (it used to default to float32, which benchmarks/full_size.py timed at 4x on a GPU)
    step = rt.step(SamplerParams()) if built == "runtime" else StepFunction(model, SamplerParams())
    canvas = mx.random.randint(0, V, (1, C)).astype(mx.int32)
    hist = step.initial_history((1, C))
    calls.clear()
    out = step(canvas, mx.zeros((1, C, V)), 0.6, mx.random.key(0), hist, cache)  # traced here
    mx.eval(out["canvas"])
    kinds = {c[0] for c in calls}
    assert kinds == {"quantized_matmul", "gather_qmm"}, kinds  # the spy saw the traced step
    bad = [c for c in calls if c[1] != mx.bfloat16 or c[2] != mx.bfloat16]
    assert not bad, f"quantized matmuls not in bfloat16: {bad}"


def test_fast_error_within_the_measured_bound(exact, fast):
    m = logit_agreement(exact, fast, prompt_len=40)
    max_err, min_top1 = BOUNDS[str(fast.activation_dtype).split(".")[-1]]
    assert 0 < m["step_max_rel_logit_error"] <= max_err
    assert 0 < m["sc_step_max_rel_logit_error"] <= max_err
    assert m["step_top1_agreement"] >= min_top1 and m["sc_step_top1_agreement"] >= min_top1


def test_fast_weights_stay_quantized_and_smaller(tiny_model_dir, exact, fast):
    def nbytes(m):
        return sum(v.nbytes for _, v in tree_flatten(m.parameters()))

    assert fast.embed_tokens["weight"].dtype == mx.uint32
    assert nbytes(fast) < nbytes(exact)  # the padded Q6_K embedding was twice as wide


def test_cli_reports_precision_and_rejects_contradictions(tiny_model_dir, capsys):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--seed", "0", "--steps", "2",
            "--max-tokens", "8", "--json"]
    assert main(args + ["--precision", "exact"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "exact (float32)"
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["precision"].startswith("fast (")
    assert main(args + ["--precision", "exact", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype" in err[0] and "Traceback" not in err[0]


def test_bench_child_that_dies_is_reported_not_waited_for():
    res = isolated("faulthandler:_sigsegv", timeout=120)
    assert "died" in res["skipped"] and "-11" in res["skipped"]


def test_real_q6k_blocks_requantize_within_the_formats_step(gemma3_reader):
    """fast's re-quantizer (``tiers.requantize_affine`` with its pairs rule, what fast and
    ``convert --precision fast`` store) on real llama.cpp Q6_K data (Gemma 3 270M), from the
    blocks' own integers and scales, its output read back by MLX's own ``dequantize``: every
    group of 32 errs by no more than rounding to the 8-bit grid of that group's range allows
    (half a step, widened by the pairs rule's ``PAIR_COARSER``, plus the float16 rounding of
    its scale and bias) and the whole tensor by no more than uniform rounding on those grids
    (step^2 / 12): bounds taken from the format, not from a measurement of ours. And against
    min-max with least-squares refits (fast's re-quantizer before, still the tiers'): a lower
    RMS error, a largest error within 10 % (benchmarks/RESULTS.md, "fast's pairs")."""
    from gguf.quants import dequantize as gguf_dequantize

    from mlx_dgemma.convert.quants import FORMATS
    from mlx_dgemma.tiers import FAST_BITS, FAST_GROUP, PAIR_COARSER, Target, requantize, requantize_affine

    q6 = [t for t in gemma3_reader.tensors if t.tensor_type.name == "Q6_K"]
    assert q6
    t = q6[0]
    raw = np.asarray(t.data)
    raw = raw.reshape(-1, raw.shape[-1])[:1024]
    rows, width = raw.shape[0], int(t.shape[0])
    w = gguf_dequantize(raw, t.tensor_type).reshape(rows, width).astype(np.float32)
    s = FORMATS[t.tensor_type].split(raw.reshape(-1, FORMATS[t.tensor_type].type_size()))
    r = requantize_affine(s.q.reshape(rows, width), s.scales.reshape(rows, -1), s.biases.reshape(rows, -1), 6, 16,
                          Target(FAST_BITS, FAST_GROUP, pairs=True))
    back = np.array(mx.dequantize(mx.array(r.weight), mx.array(r.scales).astype(mx.float32),
                                  mx.array(r.biases).astype(mx.float32), group_size=FAST_GROUP, bits=FAST_BITS))
    g, e = w.reshape(-1, FAST_GROUP), (back - w).reshape(-1, FAST_GROUP)
    lo, hi = g.min(-1), g.max(-1)
    half_step = (hi - lo) / (2 * ((1 << FAST_BITS) - 1))
    fp16 = 2.0 ** -11  # float16's relative rounding: the bias (~lo) and the scale times up to 255 steps (~hi - lo)
    per_element = PAIR_COARSER * half_step + (np.abs(lo) + PAIR_COARSER * (hi - lo)) * fp16
    assert np.all((e * e).sum(-1) <= FAST_GROUP * per_element**2 * (1 + 1e-6))
    # and over the ~20k groups, no more than rounding to each group's grid costs on average
    assert (e * e).sum() <= FAST_GROUP * ((2 * half_step) ** 2).sum() / 12
    assert np.abs(e).max() > 0  # a lossy form: the checks above had something to bound
    assert r.max_abs_error == pytest.approx(float(np.abs(e).max()), rel=1e-6)  # its own report agrees
    before = requantize(w, Target(FAST_BITS, FAST_GROUP))
    assert r.sq_error < before.sq_error and r.max_abs_error <= 1.1 * before.max_abs_error


def test_fast_from_an_exact_directory_makes_no_float_copy_of_the_weights(tmp_path):
    """fast re-quantizes the padded Q6_K weights from their packed integers where MLX holds them:
    its NumPy memory stays near the 8-bit result (1 byte a weight) and a few slices of scratch.
    It was a float32 copy of the whole tensor and the re-quantizer's temporaries over it
    (33 bytes a weight of the embedding, measured)."""
    import tracemalloc

    from mlx_dgemma.convert.converter import convert
    from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
    from mlx_dgemma.precision import apply_precision

    gguf = write_tiny_gguf(tmp_path / "v.gguf", TinySpec(vocab_size=16384), seed=3)  # a 4.2 M-weight Q6_K head
    convert(gguf, tmp_path / "exact")
    model, config = load_dir(tmp_path / "exact")
    weights = model.args.vocab_size * model.args.hidden_size
    tracemalloc.start()
    try:
        apply_precision(model, resolve_precision("fast"), config["quantization"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.embed_tokens.bits == 8 and model.embed_tokens.subblock == 32  # it was re-quantized
    assert peak < 4 * weights  # less than one float32 copy of the head


def test_exact_weights_stay_quantized(tiny_model_dir):
    model, config = load_dir(tiny_model_dir)
    params = dict(tree_flatten(model.parameters()))
    for path, spec in config["quantization"].items():
        if isinstance(spec, dict):
            assert params[f"{path}.weight"].dtype == mx.uint32, path
    stored = sum(f.stat().st_size for f in tiny_model_dir.glob("model*.safetensors"))  # not fast's sidecar
    in_memory = sum(v.nbytes for v in params.values())
    assert in_memory <= stored  # nothing expanded at load time


def test_a_runtime_refuses_a_precision_its_model_is_not_in(tiny_model_dir):
    from mlx_dgemma.runtime import Runtime

    rt = load(tiny_model_dir, precision="fast", dtype="bfloat16")
    assert rt.activation_dtype == rt.model.activation_dtype == mx.bfloat16
    with pytest.raises(ParameterError, match="does not match the model's activations"):
        Runtime(rt.model, rt.tokenizer)  # the default, exact (float32), claimed for bfloat16 activations
