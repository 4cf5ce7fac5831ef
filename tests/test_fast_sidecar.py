"""fast's sidecar: an exact directory keeps fast's re-quantized padded tensors beside its shards,
so loading fast from it re-quantizes nothing (issue 30 item 3); old directories, deleted or
damaged sidecars fall back to re-quantizing, with the same weights; verify checks the file."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_dgemma.convert.converter as converter
import mlx_dgemma.sidecar as sidecar
from mlx_dgemma import load
from mlx_dgemma.cli import main
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.verify import verify
from mlx_dgemma.loader import load_layers
from mlx_dgemma.precision import quantized_dtype_report
from mlx_dgemma.sidecar import SIDECAR_FILE


def _params(path: Path, layers: int | None = None) -> dict[str, mx.array]:
    rt = load(path, precision="fast") if layers is None else load_layers(path, layers, precision="fast")
    return dict(tree_flatten(rt.model.parameters()))


def _same(a: dict[str, mx.array], b: dict[str, mx.array]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]).item(), k


def _old(src: Path, dst: Path) -> Path:
    """``src`` as a directory converted before sidecars: no file, no record."""
    shutil.copytree(src, dst)
    (dst / SIDECAR_FILE).unlink()
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["mlx_dgemma"]["fast_sidecar"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def _refuse_requantizing(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("re-quantized at load")

    monkeypatch.setattr(sidecar, "requantize_stored", refuse)


def _tamper(path: Path, at: int = -3) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 1
    path.write_bytes(bytes(b))


def test_convert_writes_the_sidecar_and_records_it(tiny_model_dir):
    record = json.loads((tiny_model_dir / "config.json").read_text())["mlx_dgemma"]["fast_sidecar"]
    assert record["file"] == SIDECAR_FILE and (tiny_model_dir / SIDECAR_FILE).is_file()
    assert record["rule"] == sidecar.fast_rule()
    assert record["sha256"] == sidecar.file_digest(tiny_model_dir / SIDECAR_FILE)
    types = json.loads((tiny_model_dir / "config.json").read_text())["quantization"]
    padded = {k for k, v in types.items() if isinstance(v, dict) and v.get("ggml_type") in ("Q2_K", "Q3_K", "Q6_K")}
    assert set(record["tensors"]) == padded and "embed_tokens" in padded  # the Q6_K head, and only those
    report = json.loads((tiny_model_dir / "conversion_report.json").read_text())
    assert report["output_bytes"] == sum(p.stat().st_size for p in tiny_model_dir.iterdir() if p.name !=
                                         "conversion_report.json")


def test_fast_from_an_exact_directory_requantizes_nothing(tiny_model_dir, monkeypatch):
    _refuse_requantizing(monkeypatch)
    rt = load(tiny_model_dir, precision="fast")
    bits = {p: b for p, _, b, _ in quantized_dtype_report(rt.model)}
    assert bits["embed_tokens"] == 8 and bits["layers.1.experts.gate_up_proj"] == 4
    assert load_layers(tiny_model_dir, 2, precision="fast").precision.name == "fast"  # doctor's first layers


def test_the_sidecar_gives_the_weights_requantizing_gives(tmp_path, tiny_model_dir, monkeypatch):
    """Bit for bit, dtype for dtype: the sidecar, an old directory (re-quantized at load), and
    the first layers of each."""
    old = _old(tiny_model_dir, tmp_path / "old")
    _same(_params(tiny_model_dir), _params(old))
    _same(_params(tiny_model_dir, 2), _params(old, 2))
    _refuse_requantizing(monkeypatch)  # the old directory does re-quantize: the comparison above means something
    with pytest.raises(AssertionError, match="re-quantized at load"):
        load(old, precision="fast")
    assert verify(old, _gguf_of(tiny_model_dir)).ok  # a directory converted before sidecars still verifies


def _gguf_of(model_dir: Path) -> Path:
    return Path(json.loads((model_dir / "conversion_report.json").read_text())["source"])


def test_the_exact_shards_are_what_they_were_without_the_sidecar(tmp_path, tiny_gguf, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(converter, "write_fast_sidecar", lambda *a: None)  # the converter before sidecars
    convert(tiny_gguf, tmp_path / "before")
    before = {f.name: f.read_bytes() for f in (tmp_path / "before").glob("*.safetensors")}
    after = {f.name: f.read_bytes() for f in tiny_model_dir.glob("*.safetensors") if f.name != SIDECAR_FILE}
    assert before and before == after
    assert not (tmp_path / "before" / SIDECAR_FILE).exists()


@pytest.mark.parametrize("where", ["data", "record"])
def test_a_damaged_sidecar_is_never_used(tmp_path, tiny_model_dir, monkeypatch, caplog, where):
    """A changed byte (or a record that no longer matches it) is caught by the checksum at load:
    the load re-quantizes instead, says so once, and gives the right weights."""
    want = _params(tiny_model_dir)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    if where == "data":
        _tamper(bad / SIDECAR_FILE)
    else:
        cfg = json.loads((bad / "config.json").read_text())
        cfg["mlx_dgemma"]["fast_sidecar"]["sha256"] = "0" * 64
        (bad / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="mlx_dgemma.precision"):
        got = _params(bad)
    _same(want, got)
    warned = [r.getMessage() for r in caplog.records if SIDECAR_FILE in r.getMessage()]
    assert len(warned) == 1 and "checksum" in warned[0], warned
    _refuse_requantizing(monkeypatch)
    with pytest.raises(AssertionError, match="re-quantized at load"):  # it was not used
        load(bad, precision="fast")


def test_a_sidecar_of_another_rule_is_ignored(tmp_path, tiny_model_dir, monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["mlx_dgemma"]["fast_sidecar"]["rule"]["version"] = sidecar.SIDECAR_VERSION + 1
    (other / "config.json").write_text(json.dumps(cfg))
    _same(_params(tiny_model_dir), _params(other))
    _refuse_requantizing(monkeypatch)
    with pytest.raises(AssertionError, match="re-quantized at load"):
        load(other, precision="fast")


def test_verify_checks_the_sidecar_bit_for_bit(tmp_path, tiny_gguf, tiny_model_dir, capsys):
    assert verify(tiny_model_dir, tiny_gguf).ok
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    _tamper(bad / SIDECAR_FILE)
    report = verify(bad, tiny_gguf)
    assert not report.ok
    assert all(str(bad / SIDECAR_FILE) in m for m in report.mismatches)
    assert any("differ from fast's re-quantization" in m for m in report.mismatches)
    assert any("checksum" in m for m in report.mismatches)
    capsys.readouterr()
    assert main(["verify", str(bad), str(tiny_gguf)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH {bad / SIDECAR_FILE}" in out
    # deleted to save disk: verify passes, loading fast re-quantizes
    (bad / SIDECAR_FILE).unlink()
    assert verify(bad, tiny_gguf).ok


def test_verify_catches_a_sidecar_rewritten_with_its_own_checksum(tmp_path, tiny_gguf, tiny_model_dir):
    """The checksum guards against damage; verify recomputes the numbers (a consistent forgery fails too)."""
    bad = tmp_path / "forged"
    shutil.copytree(tiny_model_dir, bad)
    _tamper(bad / SIDECAR_FILE)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["mlx_dgemma"]["fast_sidecar"]["sha256"] = sidecar.file_digest(bad / SIDECAR_FILE)
    (bad / "config.json").write_text(json.dumps(cfg))
    report = verify(bad, tiny_gguf)
    assert not report.ok and any("differ from fast's re-quantization" in m for m in report.mismatches)


def test_the_space_estimate_counts_the_sidecar(tiny_gguf, tiny_model_dir):
    """convert's disk check before writing (and the full-size figure in README) price the file."""
    from mlx_dgemma.convert import GGUFSource
    from mlx_dgemma.convert.converter import fast_sidecar_bytes
    from mlx_dgemma.tiers import TensorInfo

    with GGUFSource(tiny_gguf) as s:
        estimate = fast_sidecar_bytes([TensorInfo(*i) for i in s.inventory()], s.args.num_hidden_layers)
    actual = (tiny_model_dir / SIDECAR_FILE).stat().st_size
    assert actual <= estimate <= actual + 4096  # the header's reserve is an upper bound


def test_plan_does_not_advise_converting_fast_beside_a_sidecar(tmp_path, tiny_gguf, tiny_model_dir, capsys):
    # `plan EXACT_DIR` said "to load fast without re-quantizing at every start: convert ... --precision
    # fast" though the directory's sidecar already does that; a directory without one still gets it
    assert main(["plan", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "auto loads: fast" in out and "re-quantizing" not in out and "--precision fast" not in out, out
    old = _old(tiny_model_dir, tmp_path / "old")
    assert main(["plan", str(old)]) == 0
    out = capsys.readouterr().out
    assert f"to convert once instead of at every start: `mlx-dgemma convert {tiny_gguf.name} {old}-fast " \
           "--precision fast`" in out, out
