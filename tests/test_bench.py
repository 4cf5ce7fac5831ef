"""The benchmark's own machinery on the tiny config (no peers: they are timed in RESULTS.md)."""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from mlx_dgemma.bench import CONFIGS, add_args, isolated, main, step_flops
from mlx_dgemma.cli import main as cli_main
from mlx_dgemma.model import ModelArgs


def test_bench_runs_and_writes_json(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_args(p)
    out = tmp_path / "bench.json"
    args = p.parse_args(["--configs", "tiny", "--canvas", "16", "--prompt-len", "32", "--steps", "1", "--warmup", "0",
                         "--peers", "none", "--extras", "moe,sc,quality", "--quality-prompts", "1",
                         "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert main(args) == 0
    res = json.loads(out.read_text())
    entry = res["configs"]["tiny (canvas 16)"]
    assert [r["precision"] for r in entry["rows"]] == ["exact", "fast"]  # side by side
    for ours in entry["rows"]:
        assert ours["impl"].startswith("mlx-dgemma " + ours["precision"])
        assert ours["seconds_per_step"] > 0 and ours["peak_rss_bytes"] > 0
        assert 0 < ours["fraction_of_dense_matmul"] < 10
    q = entry["quality"]
    assert 0 < q["step_max_rel_logit_error"] < 1 and 0.5 < q["step_top1_agreement"] <= 1
    assert q["blocks_compared"] >= 1
    assert "gather_qmm sorted (ours)" in entry["moe"]
    assert entry["sc_top_k"][0]["sc_top_k"] is None and entry["sc_top_k"][0]["max_rel_logit_error"] == 0.0
    assert "GFLOP/step" in capsys.readouterr().out


def test_step_flops_of_the_published_shapes():
    # The reference notes' figures for one step of the full 30-layer model (canvas 256, 1000
    # cached tokens): ~1.95 TFLOP of layers, ~0.38 TFLOP each for the tied output head and
    # self-conditioning. Each share is taken from step_flops itself (one term switched off at a
    # time), so every figure below is our FLOP model's, held against the notes'.
    cfg = dict(CONFIGS["real-shapes"])
    args = ModelArgs(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_hidden_layers=30,
                     num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
                     global_head_dim=512, layer_types=["sliding_attention"] * 5 * 5 + ["full_attention"] * 5,
                     sliding_window=1024, rope_parameters={}, vocab_size=262144, num_experts=128, top_k_experts=8,
                     moe_intermediate_size=704)
    total = step_flops(args, 256, 1000)
    without_sc = step_flops(args, 256, 1000, sc=False)
    layers = step_flops(replace(args, vocab_size=0), 256, 1000, sc=False)  # no vocabulary: no head
    head, sc = without_sc - layers, total - without_sc
    assert abs(head - 0.38e12) < 0.01e12, head
    assert abs(sc - 0.38e12) < 0.02e12, sc  # probs @ E and the small SC MLP
    assert 1.7e12 < layers < 2.3e12, layers


@pytest.mark.parametrize("flag, value, expected", [("--peers", "mlx-vlm,mlx-vml", "'mlx-vml'"),
                                                   ("--extras", "quality,breakdwn", "'breakdwn'"),
                                                   ("--configs", "tiny,huge", "'huge'"),
                                                   ("--precisions", "exact,fastest", "'exact,fastest'")])
def test_bench_rejects_a_bad_list_before_measuring(tmp_path, capsys, flag, value, expected):
    # A typo in a list must not cost a first config's measurements (nor write a cache or JSON).
    out = tmp_path / "b.json"
    rc = cli_main(["bench", "--configs", "tiny", flag, value, "--workdir", str(tmp_path / "w"), "--json", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"mlx-dgemma bench: error: {flag}: ") and expected in err[0], err
    assert not out.exists() and not (tmp_path / "w").exists()


def raise_import_error(module: str) -> None:
    """An isolated target whose import of ``module`` fails (see the test below)."""
    raise ImportError(f"No module named {module!r}", name=module)


def test_isolated_reports_a_missing_peer_but_not_a_broken_import_of_ours():
    # Only a peer's package (mlx_vlm, torch, transformers) missing means "install the peers";
    # our own module failing to import is a bug to show as such.
    peer = isolated("tests.test_bench:raise_import_error", timeout=120, module="mlx_vlm.models")
    assert peer["missing"] == "mlx_vlm.models" and "pip install" in peer["skipped"]
    ours = isolated("tests.test_bench:raise_import_error", timeout=120, module="mlx_dgemma.bench.gone")
    assert "missing" not in ours and ours["skipped"].startswith("ImportError") and "pip install" not in ours["skipped"]


# --------------------------------------------------------------------------- hostile flags (issue 24)

def _no_measuring(monkeypatch):
    """Any measurement or model build fails the test: a bad flag must be refused before them."""
    from mlx_dgemma import bench

    def measured(*a, **k):
        raise AssertionError("measured before refusing the flag")

    for name in ("dense_matmul_gflops", "build", "isolated"):
        monkeypatch.setattr(bench, name, measured)


@pytest.mark.parametrize("args, flag, expected", [
    (["--canvas", "-32"], "--canvas", "[1, 65536]"),  # before: struct.error, a 24-byte GGUF left behind
    (["--canvas", "0"], "--canvas", "[1, 65536]"),  # before: silently measured 256
    (["--warmup", "-3"], "--warmup", "[0, 10000]"),
    (["--steps", "0"], "--steps", "[1, 10000]"),
    (["--prompt-len", "-1"], "--prompt-len", "[1, 65535]"),
    (["--prompt-len", "65400"], "--prompt-len", "context of 65536"),
    (["--quality-prompts", "0"], "--quality-prompts", "[1, 5]"),
    (["--precisions", "exact", "--dtype", "bfloat16"], "--dtype", "fast"),  # before: "skipped: ...Error" rows
    (["--child-timeout", "nan"], "--child-timeout", "[1, 10000000]"),  # before: exit 0, every row timed out
    (["--child-timeout", "0"], "--child-timeout", "[1, 10000000]"),
    (["--json", "DIR"], "--json", "is a directory"),  # before: IsADirectoryError after every measurement
    (["--json", "nowhere/b.json"], "--json", "does not exist"),
    (["--workdir", "FILE"], "--workdir", "not a directory"),  # before: FileExistsError
    (["--workdir", "FILE/sub"], "--workdir", "not a directory"),
])
def test_bench_refuses_a_bad_flag_before_measuring(tmp_path, capsys, monkeypatch, args, flag, expected):
    _no_measuring(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("x")
    argv = ["bench", "--configs", "tiny", "--peers", "none", "--extras", "none"]
    if "--workdir" not in args:
        argv += ["--workdir", "w"]
    if "--json" not in args:
        argv += ["--json", "b.json"]
    rc = cli_main(argv + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"mlx-dgemma bench: error: {flag} ") and expected in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DIR", "FILE"]  # nothing left behind
    assert list((tmp_path / "DIR").iterdir()) == [] and (tmp_path / "FILE").read_text() == "x"


def _fake_row(fn_name: str, kwargs: dict) -> dict:
    if fn_name == "measure_ours":
        return {"impl": f"mlx-dgemma {kwargs['precision']}", "precision": kwargs["precision"], "dtype": "float32",
                "seconds_per_step": 1.0, "flops_per_step": 1e9, "prefill_tokens_per_second": 10.0,
                "peak_rss_bytes": 1, "load_seconds": 0.1, "first_step_seconds": 1.0}
    if fn_name == "breakdown":
        return {"attention": 0.1}
    return {"impl": fn_name, "seconds_per_step": 2.0, "prefill_tokens_per_second": 5.0}


def _fake_bench(monkeypatch, tmp_path, isolated_fn):
    from mlx_dgemma import bench

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"canvas_length": 16}))
    monkeypatch.setattr(bench, "isolated", isolated_fn)
    monkeypatch.setattr(bench, "build", lambda name, work, canvas: (tmp_path / "x.gguf", model_dir))
    monkeypatch.setattr(bench, "dense_matmul_gflops", lambda dt: 1.0)


def test_bench_dtype_goes_to_fast_only(tmp_path, capsys, monkeypatch):
    # exact is float32 by definition: --dtype bfloat16 with exact,fast made the exact row "skipped"
    calls = []

    def fake(fn_name, **kwargs):
        calls.append((fn_name, kwargs.get("precision"), kwargs.get("dtype")))
        return _fake_row(fn_name, kwargs)

    _fake_bench(monkeypatch, tmp_path, fake)
    rc = cli_main(["bench", "--configs", "tiny", "--peers", "none", "--extras", "breakdown", "--dtype", "bfloat16",
                   "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "b.json")])
    assert rc == 0
    assert sorted(c for c in calls if c[0] in ("measure_ours", "breakdown")) == [
        ("breakdown", "exact", None), ("breakdown", "fast", "bfloat16"),
        ("measure_ours", "exact", None), ("measure_ours", "fast", "bfloat16")]


def test_bench_keeps_finished_rows_on_ctrl_c(tmp_path, capsys, monkeypatch):
    """README's bench, stopped after its first rows, threw them all away: each finished row is
    written to the JSON at once, and Ctrl+C prints and keeps what had finished."""
    out = tmp_path / "b.json"
    seen_on_disk = []

    def fake(fn_name, **kwargs):
        if fn_name == "measure_hf":  # the user presses Ctrl+C during the third row
            seen_on_disk.append(json.loads(out.read_text()))
            raise KeyboardInterrupt
        return _fake_row(fn_name, kwargs)

    _fake_bench(monkeypatch, tmp_path, fake)
    rc = cli_main(["bench", "--configs", "tiny,medium", "--precisions", "exact", "--peers", "mlx-vlm,hf",
                   "--extras", "none", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 130
    # the rows were on disk before the interruption, not only written by the handler
    assert [r["impl"] for r in seen_on_disk[0]["configs"]["tiny (canvas 16)"]["rows"]] == \
        ["mlx-dgemma exact", "measure_mlx_vlm"]
    res = json.loads(out.read_text())
    assert res["interrupted"] is True
    assert [r["impl"] for r in res["configs"]["tiny (canvas 16)"]["rows"]] == ["mlx-dgemma exact", "measure_mlx_vlm"]
    assert "medium (canvas 16)" not in res["configs"]
    assert "mlx-dgemma exact" in cap.out and "measure_mlx_vlm" in cap.out  # the table of what finished
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("mlx-dgemma bench: interrupted") and "2 finished row(s)" in last and str(out) in last
    assert "Traceback" not in cap.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "m"]  # no temporary file left


def test_bench_ctrl_c_before_any_row_writes_nothing(tmp_path, capsys, monkeypatch):
    def fake(fn_name, **kwargs):
        raise KeyboardInterrupt

    _fake_bench(monkeypatch, tmp_path, fake)
    from mlx_dgemma import bench

    monkeypatch.setattr(bench, "dense_matmul_gflops", lambda dt: (_ for _ in ()).throw(KeyboardInterrupt))
    rc = cli_main(["bench", "--configs", "tiny", "--peers", "none", "--extras", "none",
                   "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and err == ["mlx-dgemma bench: interrupted before any measurement finished; nothing was written"]
    assert not (tmp_path / "b.json").exists()


def sleep_forever(pid_file: str) -> None:
    """An isolated target that records its pid and never returns (see the test below)."""
    import os
    import time

    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.1)


def test_isolated_stops_its_child_on_ctrl_c(tmp_path):
    import os
    import signal
    import threading
    import time

    pid_file = tmp_path / "pid"

    def interrupt_once_started():
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        isolated("tests.test_bench:sleep_forever", timeout=120, pid_file=str(pid_file))
    pid = int(pid_file.read_text())
    try:
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
            os.kill(pid, 0)
    finally:  # the test's own clean-up where it fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_build_leaves_no_partial_gguf(tmp_path, monkeypatch):
    # a failed write (before: a 24-byte GGUF from --canvas -32) must not be reused as a model later
    from mlx_dgemma.bench import build
    from mlx_dgemma.convert import synthetic

    def broken(path, *a, **k):
        Path(path).write_bytes(b"GGUF" + bytes(20))
        raise OSError("disk full")

    monkeypatch.setattr(synthetic, "write_tiny_gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        build("tiny", tmp_path / "w", 16)
    assert list((tmp_path / "w").iterdir()) == []


def test_the_exact_vs_compact_study_measures_the_compact_directory(tmp_path):
    """The compact directory holds fast weights, which cannot be loaded as exact: the study
    must load it in its own precision, not skip its row ("compact 1.8 MB skipped")."""
    from mlx_dgemma.bench.studies import compact_study
    from mlx_dgemma.convert.converter import convert
    from mlx_dgemma.demo import trained_demo_path

    exact_dir = tmp_path / "demo"
    convert(trained_demo_path(), exact_dir)
    formats = compact_study(trained_demo_path(), exact_dir, prompt_len=8, warmup=0, steps=1)
    for fmt in ("exact", "compact"):
        assert formats[fmt]["seconds_per_step"] is not None and formats[fmt]["seconds_per_step"] > 0, formats[fmt]


def test_the_table_keeps_its_columns_says_what_a_ratio_means_and_lists_warnings_after_itself():
    from mlx_dgemma.bench.report import table

    row = dict(seconds_per_step=0.5, prefill_tokens_per_second=100.0, peak_rss_bytes=2e9, mlx_peak_bytes=1e9)
    ours = dict(row, impl="mlx-dgemma fast (bfloat16)", vs={"mlx-vlm 8-bit (group 64, its own quantization)": 1.15},
                flops_per_step=1e9, achieved_gflops=2.0, fraction_of_dense_matmul=0.5, dtype="bfloat16",
                load_seconds=0.1, first_step_seconds=0.2)
    long_peer = dict(row, impl="mlx-vlm 8-bit (group 64, its own quantization)", seconds_per_step=0.4,
                     warnings=["FutureWarning: `x` is deprecated"])
    result = {"machine": {"platform": "p", "device": "cpu", "mlx": "0"}, "dense_matmul_gflops": {"float32": 1.0},
              "configs": {"tiny": {"rows": [ours, long_peer]}}}
    lines = table(result).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("implementation"))
    # a long name widens the column instead of pushing its row's figures out of line: the
    # ms/step figures end where their heading ends
    ends = [lines[header].index("ms/step") + len("ms/step"),
            lines[header + 1].index("500.0") + len("500.0"), lines[header + 2].index("400.0") + len("400.0")]
    assert len(set(ends)) == 1, lines[header:header + 3]
    ratio = next(line for line in lines if "1.15x" in line)
    assert "time per step" in ratio and "slower" in ratio
    warn_at = lines.index("warnings raised during the measurements:")
    assert warn_at > header + 2 and "`x` is deprecated" in lines[warn_at + 1]
    assert not any("deprecated" in line for line in lines[:warn_at])


def test_bench_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 3)" in out and "(default: bench.json)" in out
    assert "(default: None)" not in out and "(default 512) (default" not in out


def warn_then_measure() -> dict:
    import warnings

    warnings.warn("peer says: deprecated", FutureWarning)
    return {"impl": "peer", "seconds_per_step": 1.0}


def test_isolated_keeps_a_measurements_warnings_with_its_row():
    row = isolated("tests.test_bench:warn_then_measure", timeout=120)
    assert row["warnings"] == ["FutureWarning: peer says: deprecated"]
