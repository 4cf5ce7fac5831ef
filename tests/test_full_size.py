"""benchmarks/full_size.py's inventory writer: the header it streams is the published one
(metadata, tensor names, shapes, types, offsets), its blocks are valid, and the byte total of
the whole inventory is the published file's. The full run (40 GB of disk) is not a test."""

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "tests" / "data" / "diffusiongemma-26b-a4b-it-q4_k_m.header.json"
PUBLISHED_DATA_BYTES = 16_790_985_600  # the published file's tensor data (tests/data/README.md)


@pytest.fixture(scope="module")
def fs():
    return load_script("benchmarks/full_size.py")


@pytest.fixture(scope="module")
def header():
    return json.loads(HEADER.read_text())


def test_inventory_bytes_equal_the_published_file(fs, header):
    assert len(header["tensors"]) == 692
    assert fs.data_bytes(header["tensors"]) == PUBLISHED_DATA_BYTES


def test_written_header_is_the_published_one(fs, header, tmp_path):
    # The published tensors outside the layers (the 0.6 GB embedding left out) and layer 0's
    # (its two expert tensors, 0.55 GB, left out): every type, ~40 MB of data.
    def small(name):
        return name != "token_embd.weight" and (
            not name.startswith("blk.") or (name.startswith("blk.0.") and "_exps.weight" not in name))

    picked = [t for t in header["tensors"] if small(t["name"])]
    assert {t["type"] for t in picked} >= {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}, "pick covers every type"
    path = fs.write_inventory_gguf(tmp_path / "x.gguf", header, select=small, seed=1)
    assert not (tmp_path / "x.gguf.partial").exists()
    r = GGUFReader(path)

    # metadata: every published key; the non-summarized ones with the published value, the
    # summarized tokenizer arrays with the published length (merges and template excepted)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    for k, v in header["metadata"].items():
        if k == "tokenizer.chat_template":
            assert k not in fields
            continue
        assert k in fields, k
        got = fields[k].contents()
        if isinstance(v, str) and v.startswith("<array of"):
            n = int(v.split()[2])
            if k != "tokenizer.ggml.merges":
                assert len(got) == n, k
        elif isinstance(v, float):
            assert got == pytest.approx(v, rel=1e-6), k
        else:
            assert got == v, k

    # tensors: names, GGUF shapes, types, in order, aligned data of the published sizes
    assert [t.name for t in r.tensors] == [t["name"] for t in picked]
    for t, ref in zip(r.tensors, picked):
        assert [int(x) for x in t.shape] == ref["ne"], t.name
        assert t.tensor_type.name == ref["type"], t.name
        assert int(t.n_bytes) == fs.tensor_nbytes(ref["ne"], t.tensor_type), t.name
        assert t.data_offset % fs.ALIGNMENT == 0
        vals = dequantize(t.data, t.tensor_type) if ref["type"] != "F32" else np.asarray(t.data)
        assert np.isfinite(vals).all(), t.name
        if ref["type"] != "F32":  # valid random blocks of the chosen spread, centred
            assert 0.01 < float(vals.std()) < 0.04, t.name
            assert abs(float(vals.mean())) < 0.005, t.name


def test_written_gguf_is_what_the_converter_reads(fs, header, tmp_path):
    """The metadata alone opens as a DiffusionGemma model (config and tokenizer of the
    published size), so the full run's file is one our converter accepts."""
    from mlx_dgemma.convert.metadata import args_from_metadata

    md = fs.synthetic_metadata(header)
    args = args_from_metadata(md, fs.vocab_size(header))
    assert args.num_hidden_layers == 30 and args.vocab_size == 262144 and args.num_experts == 128
    assert len(md["tokenizer.ggml.tokens"]) == 262144


def test_interrupted_write_leaves_no_file(fs, header, tmp_path, monkeypatch):
    from mlx_dgemma.convert import synthetic

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "random_tensor", boom)
    with pytest.raises(KeyboardInterrupt):
        fs.write_inventory_gguf(tmp_path / "y.gguf", header, select=lambda n: not n.startswith("blk."))
    assert list(tmp_path.iterdir()) == []


def sleep_a_while(seconds: float) -> dict:
    """An isolated target that would run for ``seconds`` (see the test below)."""
    import time

    time.sleep(seconds)
    return {"impl": "slept"}


def test_isolated_stops_a_child_below_the_memory_floor():
    """The full run's watchdog: a child is killed, and its row says why, once the machine's
    available memory is below the floor (here: a floor no machine has)."""
    import time

    from mlx_dgemma.bench import isolated

    t0 = time.monotonic()
    res = isolated("tests.test_full_size:sleep_a_while", timeout=120, min_available_bytes=1 << 62, seconds=60)
    assert "available memory fell" in res["skipped"]
    assert time.monotonic() - t0 < 30
    ok = isolated("tests.test_full_size:sleep_a_while", timeout=120, min_available_bytes=1, seconds=0)
    assert ok["impl"] == "slept" and "skipped" not in ok


def test_tier_layout_only_writes_what_the_real_tier_conversion_writes(fs, tmp_path):
    """--tier-layout-only replaces only the re-quantizer's values: config.json and every
    tensor's name, dtype and shape equal a real ``convert --precision q3`` of the same file."""
    from mlx_dgemma.convert.synthetic import write_tiny_gguf
    from mlx_dgemma.convert.verify import open_safetensors

    gguf = write_tiny_gguf(tmp_path / "t.gguf")
    fake = fs.measure_tier_layout(str(gguf), str(tmp_path / "fake"), "q3")
    real = fs.measure_convert(str(gguf), str(tmp_path / "real"), "q3")
    assert fake["tensors"] == real["tensors"]
    # the same bytes of weights (conversion_report.json differs: it records the errors)
    assert [f.stat().st_size for f in sorted((tmp_path / "fake").glob("*.safetensors"))] == \
        [f.stat().st_size for f in sorted((tmp_path / "real").glob("*.safetensors"))]
    cfg = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("fake", "real")]
    assert cfg[0] == cfg[1] and cfg[0]["mlx_dgemma"]["weights"] == "q3"
    a, b = (open_safetensors(tmp_path / d / "model.safetensors") for d in ("fake", "real"))
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    # and the values are not the real ones (the stand-in is in place of the re-quantizer)
    assert any(not np.array_equal(a[k], b[k]) for k in a if k.endswith(".scales"))


def test_the_run_on_a_tiny_model_prints_a_table_and_json(fs, tmp_path, capsys):
    """The whole script's plumbing (children, results file, table, JSON) on a tiny model
    standing in for the full-size file; a rerun keeps what the results file has."""
    from mlx_dgemma.convert.synthetic import write_tiny_gguf

    write_tiny_gguf(tmp_path / fs.GGUF_NAME)
    argv = ["--workdir", str(tmp_path), "--precisions", "exact", "--prefill-tokens", "8", "--canvas", "32",
            "--min-free-gb", "0", "--skip-write", "--skip-load-gguf"]
    assert fs.main(argv) == 0
    out = capsys.readouterr().out
    table, _, js = out.partition("\n{")
    rows = json.loads("{" + js)["rows"]
    assert set(rows) == {"convert", "verify", "load dir exact"}
    assert rows["verify"]["ok"] and rows["verify"]["exact"] == rows["verify"]["checked"] == 75
    r = rows["load dir exact"]
    assert r["resident_bytes"] > 0 and r["prefill_tokens"] == 8 and r["step_seconds"] > 0
    assert "load dir exact" in table and "step, canvas 32" in table
    assert not list(tmp_path.glob(".partial-*"))
    saved = json.loads((tmp_path / "full_size.json").read_text())["rows"]
    assert fs.main(argv) == 0  # nothing measured again
    assert json.loads((tmp_path / "full_size.json").read_text())["rows"] == saved


@pytest.mark.parametrize("n", [1, 6])
def test_first_layers_file_is_a_consistent_n_layer_model(fs, header, tmp_path, n):
    """--layers N: the file holds blocks 0..N-1 and everything outside the blocks at the published
    shapes, and its metadata (block count, every per-layer array) says N layers, so the
    converter's checks and args_from_metadata take it as an N-layer model whose tensors are
    exactly the kept ones. N = 6 takes in the first global layer (no attn_v, 2 KV heads)."""
    from mlx_dgemma.convert.metadata import args_from_metadata, check_gguf_metadata, field_kinds, read_metadata
    from mlx_dgemma.convert.source import open_gguf
    from mlx_dgemma.convert.names import expected_tensors

    cut = fs.first_layers(header, n)
    full_md = header["metadata"]
    assert [t for t in header["tensors"] if t["name"] == "token_embd.weight"][0] in cut["tensors"]

    def tiny(name):  # the file's header and its tiny tensors (the norms, scales, rope factors)
        ne = next(t["ne"] for t in cut["tensors"] if t["name"] == name)
        return int(np.prod(ne)) <= 4096

    path = fs.write_inventory_gguf(tmp_path / fs.gguf_name(n), cut, select=tiny, seed=2)
    r = open_gguf(path, architecture=None)  # the converter's own reading of the header
    md = read_metadata(r)
    vocab = check_gguf_metadata(md, field_kinds(r), str(path))
    args = args_from_metadata(md, vocab)
    assert md["diffusion-gemma.block_count"] == args.num_hidden_layers == n
    pattern = full_md["diffusion-gemma.attention.sliding_window_pattern"][:n]
    assert md["diffusion-gemma.attention.sliding_window_pattern"] == pattern
    assert md["diffusion-gemma.attention.head_count_kv"] == full_md["diffusion-gemma.attention.head_count_kv"][:n]
    assert args.layer_types == ["sliding_attention" if s else "full_attention" for s in pattern]
    assert args.num_global_key_value_heads == (2 if n > 5 else args.num_key_value_heads)
    assert (args.vocab_size, args.hidden_size, args.num_experts) == (262144, 2816, 128)
    # the inventory the converter requires of an N-layer model is exactly what the file keeps
    assert {e.name: list(e.ne) for e in expected_tensors(args)} == {t["name"]: t["ne"] for t in cut["tensors"]}
    assert {t.name for t in r.tensors} == {t["name"] for t in cut["tensors"] if tiny(t["name"])}
    assert all(int(t["name"].split(".")[1]) < n for t in cut["tensors"] if t["name"].startswith("blk."))


def test_first_layers_refuses_a_count_the_header_lacks(fs, tmp_path, capsys):
    for bad in ("0", "31"):
        with pytest.raises(SystemExit) as e:
            fs.main(["--workdir", str(tmp_path), "--layers", bad])
        assert e.value.code == 2
        assert f"--layers {bad}: expected a number of layers in [1, 30]" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_results_file_of_another_layer_count_is_refused(fs, tmp_path, capsys):
    """Rows measured on the whole model (a results file from before --layers has no "layers")
    are never mixed with an N-layer run's."""
    (tmp_path / "full_size.json").write_text(json.dumps({"rows": {"convert": {"seconds": 1.0}}}))
    with pytest.raises(SystemExit) as e:
        fs.main(["--workdir", str(tmp_path), "--layers", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "holds a run of all layers, this one is of --layers 2; give this run its own --results" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full_size.json"]  # nothing written
