"""`mlx-dgemma doctor`: the machine report and the default-device-vs-CPU checks.

These tests describe a machine without a GPU (CI's: MLX's CPU backend), where the command
compares MLX's CPU with itself (compiled vs eager step) and must say so; each check is shown to
fail when the default device's numbers are corrupted (through ``perturb``, the comparison's own
argument). On a machine with a GPU (a Mac), MLX's CPU device stands in as the default device
(``cpu_default``), so they test the same thing there; the GPU paths are faked where they are tested.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import doctor, doctor_device  # backend_name is patched where it lives
from mlx_dgemma.cli import build_parser, main


@pytest.fixture(scope="module", autouse=True)
def cpu_default():
    """MLX's default device is the CPU for these tests (already so without a GPU); module-scoped
    and autouse, so it is in place before ``demo_outputs`` runs."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def doctor_args(*argv: str):
    return build_parser().parse_args(["doctor", *argv])


@pytest.fixture(scope="module")
def demo_outputs():
    """One run of the demo on each side (the comparison's inputs), shared by the unit tests."""
    from mlx_dgemma import load_demo
    from mlx_dgemma.sampler import SamplerParams

    rt = load_demo(precision="exact")
    model, tok = rt.model, rt.tokenizer
    params = SamplerParams.from_config(rt.generation_config)
    inp = doctor.fixed_input(model.args, tok.encode(doctor.FIXED_PROMPT), model.args.canvas_length, params.t_max)
    return doctor.subject_and_reference(model, inp, rt.activation_dtype, params)


def test_quick_run_exits_0_and_says_there_is_no_gpu(capsys):
    assert main(["doctor", "--quick"]) == 0
    out, err = capsys.readouterr()
    assert "no GPU" in out and "backend cpu" in out
    assert "result:        all 3 checks agree" in out
    for name in ("prefill KV cache", "denoiser logits", "sampler argmax"):
        assert f"ok   demo, exact (float32): {name}" in out
    assert "[doctor" in err and "demo" in err  # progress on stderr


def test_json_schema_with_a_model(capsys, tiny_model_dir):
    assert main(["doctor", "--quick", "--json", "--model", str(tiny_model_dir), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out)  # one JSON object, nothing else on stdout
    assert set(r) == {"ok", "exit_code", "device", "memory", "kernel_cache", "fit", "thresholds_provisional",
                      "checks", "failed", "seconds"}
    assert r["ok"] is True and r["exit_code"] == 0 and r["failed"] == []
    assert r["device"] == {**r["device"], "default_device": "cpu", "backend": "cpu", "gpu": False}
    assert r["memory"]["kind"] == "available RAM" and r["memory"]["bytes"] > 0
    assert r["kernel_cache"]["applies"] is False
    assert r["thresholds_provisional"] is False  # CPU vs CPU uses the measured float32 row
    assert [p["precision"] for p in r["fit"]["precisions"]] == ["exact", "fast", "q4", "q3"]  # the plan's rows
    files = sum(f.stat().st_size for f in tiny_model_dir.glob("model*.safetensors"))  # not fast's sidecar
    assert 0.9 * files <= r["fit"]["weights_bytes"] <= files  # the weights, without the files' headers
    cases = {c["case"] for c in r["checks"]}
    assert cases == {"demo", "tiny (first 2 layers)"}
    for c in r["checks"]:
        assert set(c) == {"case", "precision", "check", "value", "threshold", "ok", "detail", "provisional",
                          "model_fault", "label"}
        assert c["check"] in ("kv", "logits", "argmax") and c["ok"] is True


def test_a_corrupted_comparison_exits_1_naming_the_check(capsys):
    def perturb(quantity: str, a: np.ndarray) -> np.ndarray:  # 0.1 % off: far beyond float32 rounding
        return a * 1.001 if quantity == "logits" else a

    assert doctor.main(doctor_args("--quick"), perturb=perturb) == 1
    out = capsys.readouterr().out
    assert "FAIL demo, exact (float32): denoiser logits" in out
    assert "1 of 3 checks FAILED: demo, exact (float32): denoiser logits" in out
    assert "ok   demo, exact (float32): prefill KV cache" in out


@pytest.mark.parametrize("quantity, corrupt", [
    ("kv", lambda a: a + 1e-3 * np.abs(a).max() if a.dtype.kind == "f" else a),
    ("logits", lambda a: a + np.random.default_rng(0).normal(0, 1e-3, a.shape) * np.abs(a).max()),
    ("argmax", lambda a: np.roll(a, 1)),
])
def test_each_check_fails_when_its_numbers_are_wrong(demo_outputs, quantity, corrupt):
    subject, reference = demo_outputs
    tol = doctor.tolerance("cpu", "float32")
    clean = doctor.compare("demo", "exact (float32)", subject, reference, tol)
    assert all(c.ok for c in clean)
    checks = doctor.compare("demo", "exact (float32)", subject, reference, tol,
                            perturb=lambda q, a: corrupt(a) if q == quantity else a)
    assert [c.check for c in checks if not c.ok] == [quantity]
    report = doctor.Report(doctor.device_info(), doctor.MemoryInfo("x", 1), doctor.KernelCache(False), None, checks)
    r = report.to_json()
    assert r["ok"] is False and r["exit_code"] == 1
    assert r["failed"] == [f"demo, exact (float32): {doctor.CHECK_NAMES[quantity]}"]


def test_rounding_level_differences_pass(demo_outputs):
    """The float32 thresholds are not zero: relative noise of 1e-6 (a few float32 roundings
    through the network) passes; a NaN fails."""
    subject, reference = demo_outputs
    tol = doctor.tolerance("cpu", "float32")
    noisy = doctor.compare("demo", "exact", subject, reference, tol,
                           perturb=lambda q, a: a * (1 + 1e-6) if a.dtype.kind == "f" else a)
    assert all(c.ok for c in noisy)
    nan = doctor.compare("demo", "exact", subject, reference, tol,
                         perturb=lambda q, a: np.where(np.arange(a.size).reshape(a.shape) == 0, np.nan, a)
                         if q == "logits" else a)
    assert [c.check for c in nan if not c.ok] == ["logits"]


def test_gpu_thresholds_are_one_table_marked_provisional(demo_outputs):
    for (backend, dtype), tol in doctor.THRESHOLDS.items():
        assert tol.measured == (backend == "cpu"), (backend, dtype)
        assert tol.kv >= doctor.THRESHOLDS[("cpu", "float32")].kv and tol.argmax == 1.0
    subject, reference = demo_outputs
    checks = doctor.compare("demo", "fast (bfloat16)", subject, reference, doctor.tolerance("metal", "bfloat16"))
    report = doctor.Report(doctor.device_info(), doctor.MemoryInfo("x", 1), doctor.KernelCache(False), None, checks)
    assert report.provisional and report.to_json()["thresholds_provisional"] is True
    assert any(line.startswith("thresholds:    provisional") for line in report.lines())


def test_fit_says_which_precision_fits(tiny_model_dir):
    """The fit line is the loader's memory plan against the memory given: all fit with room to
    spare, none with a byte, and between the most and least exact precision's needs only the
    smaller ones (the tiers are smaller than exact, so such a limit exists)."""
    roomy = doctor.precision_fit(tiny_model_dir, doctor.MemoryInfo("available RAM", 1 << 40))
    assert [p.precision for p in roomy.precisions][:2] == ["exact", "fast"]
    assert all(p.fits for p in roomy.precisions)
    assert all(p.needed_bytes > roomy.weights_bytes for p in roomy.precisions if p.precision == "exact")
    none = doctor.precision_fit(tiny_model_dir, doctor.MemoryInfo("available RAM", 1))
    assert not any(p.fits for p in none.precisions)
    needs = {p.precision: p.needed_bytes for p in roomy.precisions}
    limit = (needs["exact"] + min(needs.values())) // 2
    assert min(needs.values()) < limit < needs["exact"]
    mid = {p.precision: p.fits for p in doctor.precision_fit(tiny_model_dir, doctor.MemoryInfo("x", limit)).precisions}
    assert mid["exact"] is False and any(mid.values())
    unknown = doctor.precision_fit(tiny_model_dir, doctor.MemoryInfo("available RAM", None))
    assert all(p.fits is None for p in unknown.precisions)


def test_gpu_memory_and_the_cuda_kernel_cache(monkeypatch, tmp_path):
    """The GPU-only paths, on this CPU machine with the backend and MLX's device info faked."""
    monkeypatch.setattr(doctor_device, "backend_name", lambda: "metal")
    monkeypatch.setattr(doctor.mx, "device_info", lambda: {"max_recommended_working_set_size": 48 << 30,
                                                           "memory_size": 64 << 30})
    assert doctor.usable_memory() == doctor.MemoryInfo("Metal recommended working set", 48 << 30)
    assert doctor.kernel_cache().applies is False  # Metal kernels are precompiled
    monkeypatch.setattr(doctor_device, "backend_name", lambda: "cuda")
    monkeypatch.setattr(doctor.mx, "device_info", lambda: {"device_name": "H100", "free_memory": 70 << 30})
    assert doctor.usable_memory().bytes == 70 << 30
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    cold = doctor.kernel_cache()
    assert cold.applies and cold.files == 0 and cold.note.startswith("empty")
    (tmp_path / "ptx" / "sub").mkdir(parents=True)
    (tmp_path / "ptx" / "sub" / "qmm.ptx").write_bytes(b"x" * 1000)
    warm = doctor.kernel_cache()
    assert (warm.dir, warm.files, warm.bytes) == (str(tmp_path / "ptx"), 1, 1000) and warm.note.startswith("warm")


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: (p / "empty").mkdir() or p / "empty"])
def test_bad_model_path_is_one_line_exit_2(capsys, tmp_path, make):
    path = make(tmp_path)
    assert main(["doctor", "--quick", "--model", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("[doctor")]
    assert len(lines) == 1 and lines[0].startswith("mlx-dgemma doctor: error: ") and str(path) in lines[0]
    assert "demo" not in err  # refused before any check ran
    assert out == ""


def test_bad_layers_is_exit_2(capsys):
    assert main(["doctor", "--quick", "--layers", "0"]) == 2
    assert "--layers 0" in capsys.readouterr().err


@pytest.mark.slow  # the real-shapes layer: a 611 MB GGUF built and converted; ~15 s on a free 2-core CPU, 74 s loaded
def test_full_run_with_the_real_shapes_layer(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ok   real-shapes layer, exact (float32): denoiser logits" in out
    assert "all 6 checks agree" in out


# --------------------------------------------------------------------------------------------
# --report FILE (issue 30, item 8) and the Metal rows (item 5), Metal simulated


def test_report_file_holds_the_machine_plan_checks_and_timings(capsys, tmp_path, tiny_model_dir):
    path = tmp_path / "report.json"
    assert main(["doctor", "--quick", "--model", str(tiny_model_dir), "--report", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"report written to {path}" in err
    r = json.loads(path.read_text())
    m = r["machine"]
    assert m["chip"] and m["ram_bytes"] > 0 and m["os"] and m["python"].startswith("CPython")
    assert m["mlx"] == r["device"]["mlx_version"] and "MLX_ENABLE_TF32" in m
    # the plan for the model, as `mlx-dgemma plan MODEL --json` prints it
    assert [p["precision"] for p in r["plan"]["precisions"]] == ["exact", "fast", "q4", "q3"]
    assert r["plan"]["model"] == str(tiny_model_dir)
    assert r["ok"] is True and {c["case"] for c in r["checks"]} == {"demo", "tiny (first 2 layers)"}
    timings = {t["case"]: t for t in r["timings"]}
    assert set(timings) == {"demo", "tiny (first 2 layers)"}
    for t in timings.values():
        assert t["precision"] == "exact (float32)" and t["load_seconds"] > 0
        assert t["prompt_tokens"] > 0 and t["prefill_tokens_per_second"] > 0
        assert t["steps"] >= 1 and t["seconds_per_step"] > 0 and t["peak_memory_bytes"] > 0
        assert t["answer_tokens_per_second"] >= 0 and t["answer_tokens"] >= 0
    assert timings["demo"]["answer_tokens"] > 0 and timings["demo"]["answer_tokens_per_second"] > 0
    assert timings["tiny (first 2 layers)"]["steps"] <= doctor.REPORT_MODEL_STEPS
    assert "timing:        demo, exact (float32): load" in out  # the text report shows them too


def test_a_failing_machine_still_writes_its_report(capsys, tmp_path):
    path = tmp_path / "report.json"

    def perturb(quantity: str, a: np.ndarray) -> np.ndarray:
        return a * 1.001 if quantity == "logits" else a

    args = doctor_args("--quick", "--report", str(path))
    assert doctor.main(args, perturb=perturb) == 1
    r = json.loads(path.read_text())
    assert r["ok"] is False and r["failed"] == ["demo, exact (float32): denoiser logits"]
    assert r["plan"] is None and [t["case"] for t in r["timings"]] == ["demo"]


@pytest.mark.parametrize("make, says", [(lambda p: p, "is a directory"),
                                        (lambda p: p / "no-such-dir" / "r.json", "does not exist")])
def test_a_report_path_that_cannot_be_written_is_refused_before_any_check(capsys, tmp_path, make, says):
    path = make(tmp_path)
    assert main(["doctor", "--quick", "--report", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("[doctor")]
    assert len(lines) == 1 and lines[0].startswith("mlx-dgemma doctor: error: --report ") and says in lines[0]
    assert "demo" not in err and out == ""


@pytest.fixture
def simulated_metal(monkeypatch):
    """An M5-class Mac on macOS 26.2 as MLX would describe it; the computation stays on the CPU."""
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")  # restored after the test
    monkeypatch.delenv("MLX_ENABLE_TF32")
    monkeypatch.setattr(doctor_device, "backend_name", lambda: "metal")
    monkeypatch.setattr(doctor.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(doctor.mx, "device_info", lambda: {
        "device_name": "Apple M5", "architecture": "applegpu_g17s", "memory_size": 32 << 30,
        "max_recommended_working_set_size": 24 << 30})
    monkeypatch.setattr("platform.mac_ver", lambda: ("26.2", ("", "", ""), "arm64"))


def test_a_nax_mac_gets_its_row_and_the_float32_matmul_check(capsys, simulated_metal):
    import os

    assert main(["doctor", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "matmul units:  NAX (applegpu_g17s, macOS 26.2+)" in out and "MLX_ENABLE_TF32=0" in out
    assert "ok   device, exact (float32): float32 matmul" in out
    assert os.environ["MLX_ENABLE_TF32"] == "0"  # set before the checks' first matmul


def test_the_float32_matmul_check_fails_at_reduced_precision(capsys, simulated_metal):
    def tf32(quantity: str, a: np.ndarray) -> np.ndarray:  # float32 inputs rounded to TF32's 10-bit mantissa
        if quantity != "matmul":
            return a
        return a + np.random.default_rng(0).normal(0, 5e-4, a.shape) * np.abs(a).max()

    assert doctor.main(doctor_args("--quick"), perturb=tf32) == 1
    out = capsys.readouterr().out
    assert "FAIL device, exact (float32): float32 matmul" in out and "exact is not exact here" in out


def test_a_mac_without_nax_says_so(capsys, simulated_metal, monkeypatch):
    monkeypatch.setattr(doctor.mx, "device_info", lambda: {
        "device_name": "Apple M2", "architecture": "applegpu_g14g", "memory_size": 16 << 30,
        "max_recommended_working_set_size": 11 << 30})
    assert main(["doctor", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "matmul units:  no NAX (applegpu_g14g): float32 matmuls are IEEE float32" in out


# --------------------------------------------------------------------------------------------
# --model's first layers come from the loader (issue 34: doctor has no loader of its own)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_the_first_layers_are_the_loaders_model_cut_short(tiny_model_dir, tiny_gguf, all_types_model_dir, precision):
    """`loader.load_layers` (doctor's --model case and its timings) holds, for a converted directory
    and for a .gguf alike, exactly the weights `load` gives the whole model in that precision, for
    the first layers only; fast's repacked weights included (all_types has 5-bit legacy ones),
    which doctor's own loader left out."""
    from mlx.utils import tree_flatten

    from mlx_dgemma.loader import load, load_layers

    cases = ((tiny_model_dir, (tiny_model_dir, tiny_gguf)), (all_types_model_dir, (all_types_model_dir,)))
    for whole_path, paths in cases:
        whole = dict(tree_flatten(load(whole_path, precision=precision).model.parameters()))
        for path in paths:
            rt = load_layers(path, 1, precision)
            assert rt.model.args.num_hidden_layers == 1 and rt.precision.name == precision
            part = dict(tree_flatten(rt.model.parameters()))
            assert any(k.startswith("layers.0.") for k in part)
            assert not any(k.startswith("layers.") and not k.startswith("layers.0.") for k in part)
            assert set(part) <= set(whole), set(part) - set(whole)
            bad = [k for k, a in part.items() if a.dtype != whole[k].dtype or not mx.array_equal(a, whole[k]).item()]
            assert not bad, (path, bad[:5])


def test_load_layers_refuses_a_layer_count_below_one(tiny_model_dir):
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.loader import load_layers

    with pytest.raises(ParameterError, match="layers 0"):
        load_layers(tiny_model_dir, 0)
