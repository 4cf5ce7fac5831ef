"""The benchmark's own machinery on the tiny config (no peers: they are timed in RESULTS.md)."""

import argparse
import json

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
    # One step of the full 30-layer model: ~1.95 TFLOP of layers + ~0.38 each for head and SC
    # (the figures in the reference notes), with 1000 cached tokens.
    cfg = dict(CONFIGS["real-shapes"])
    args = ModelArgs(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_hidden_layers=30,
                     num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
                     global_head_dim=512, layer_types=["sliding_attention"] * 5 * 5 + ["full_attention"] * 5,
                     sliding_window=1024, rope_parameters={}, vocab_size=262144, num_experts=128, top_k_experts=8,
                     moe_intermediate_size=704)
    head = 2 * 256 * 2816 * 262144
    total = step_flops(args, 256, 1000)
    layers = total - 2 * head - 2 * 256 * 3 * 2816 * 2112
    assert 1.7e12 < layers < 2.3e12
    assert abs(head - 0.378e12) < 0.01e12


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
