"""What a newcomer meets first (issue 13): paths as README writes them (``~``, variables),
flags in either place, help texts, the demo's notice, fast rejection of a wrong GGUF."""

from __future__ import annotations

import json

import pytest

from mlx_dgemma import load
from mlx_dgemma.cli import build_parser, main
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $HOME, so ``~`` means a directory this test owns."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_load_expands_home_and_variables(home, tiny_model_dir, monkeypatch):
    (home / "models").mkdir()
    (home / "models" / "dgemma").symlink_to(tiny_model_dir)
    rt = load("~/models/dgemma")  # README's snippet, as written
    model, tok = rt.model, rt.tokenizer
    assert model.args.canvas_length == 32 and tok.encode("hi")
    monkeypatch.setenv("DGEMMA_MODELS", str(home / "models"))
    assert load("$DGEMMA_MODELS/dgemma").model.args.vocab_size == model.args.vocab_size


def test_cli_paths_expand_home(home, tiny_gguf, capsys):
    """convert creates missing parents (mkdir -p), verify and --model/--trace take ``~``."""
    assert main(["convert", str(tiny_gguf), "~/models/new/dgemma"]) == 0
    assert (home / "models" / "new" / "dgemma" / "config.json").is_file()
    assert main(["verify", "~/models/new/dgemma", str(tiny_gguf)]) == 0
    assert main(["generate", "--model", "~/models/new/dgemma", "--prompt", "hi", "--seed", "0", "--steps", "2",
                 "--max-tokens", "32", "--trace", "~/trace.jsonl"]) == 0
    records = [json.loads(x) for x in (home / "trace.jsonl").read_text().splitlines()]
    assert records[0]["record"] == "header" and records[0]["prompt"] == "hi" and records[0]["seed"] == 0
    assert records[1]["block"] == 1  # 1-based, as every user-facing number
    assert "all exact" in capsys.readouterr().out


def test_failed_convert_removes_the_parents_it_created(home, tiny_gguf, monkeypatch, capsys):
    from mlx_dgemma.convert import converter

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(converter, "_write_shards", disk_full)
    assert main(["convert", str(tiny_gguf), "~/a/b/c"]) == 2
    assert "no space left" in capsys.readouterr().err
    assert not (home / "a").exists()  # nothing half-written, not even the parents


def test_model_from_the_environment_expands_home(home, monkeypatch):
    from mlx_dgemma.tui.app import configured_model

    monkeypatch.setenv("MLX_DGEMMA_MODEL", "~/models/dgemma")
    assert configured_model() == str(home / "models" / "dgemma")
    monkeypatch.setenv("MLX_DGEMMA_MODEL", "")
    assert configured_model() is None


def test_chat_with_a_missing_model_from_the_environment_is_one_line(home, monkeypatch, capsys):
    monkeypatch.setenv("MLX_DGEMMA_MODEL", "~/models/nope")
    assert main(["chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mlx-dgemma chat: error: {home}/models/nope (from MLX_DGEMMA_MODEL): no such file or "
                   "directory; give a .gguf file or a directory written by `mlx-dgemma convert`")


@pytest.mark.parametrize("argv", [["--debug", "convert", "/nope.gguf", "/tmp/x"],
                                  ["convert", "--debug", "/nope.gguf", "/tmp/x"],
                                  ["convert", "/nope.gguf", "/tmp/x", "--debug"]])
def test_debug_before_or_after_the_subcommand(argv):
    from mlx_dgemma.errors import DGemmaError

    with pytest.raises(DGemmaError):  # --debug: the traceback, not the one-line error
        main(argv)


def test_debug_is_off_unless_given():
    assert build_parser().parse_args(["convert", "a", "b"]).debug is False


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_demo_and_model_together_are_refused(command, capsys):
    argv = [command, "--demo", "--model", "/nope"] + (["--prompt", "hi"] if command == "generate" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--demo and --model /nope: give one of them" in err


def test_help_texts(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "`" not in top and "chat --demo" in top
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("mlx-dgemma 0.")
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    chat = capsys.readouterr().out
    assert "MLX_DGEMMA_MODEL" in chat and "Ctrl+T" in chat and "Ctrl+O" in chat
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    verify = capsys.readouterr().out
    assert "written by mlx-dgemma convert" in verify and "converted from" in verify
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    gen = capsys.readouterr().out
    assert "--precision" in gen and "bfloat16 on a GPU" in gen


def test_generate_demo_says_what_it_is_and_writes_no_control_bytes(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    assert main(["generate", "--demo", "--prompt", "Why is the sky blue?", "--seed", "0", "--steps", "4",
                 "--max-tokens", "64"]) == 0
    out, err = capfd.readouterr()
    assert "not DiffusionGemma's weights" in err
    assert out.strip()
    assert not [c for c in out if ord(c) < 32 and c not in "\n\t"] and "\x7f" not in out


def test_wrong_architecture_is_rejected_from_the_first_keys(tmp_path, monkeypatch):
    """The architecture key comes first in a GGUF: a wrong file is refused by the pre-scan from
    that key, before the rest of the header is walked or a header is built from it."""
    from mlx_dgemma.convert import source
    from mlx_dgemma.convert.errors import ConvertError

    ours = write_tiny_gguf(tmp_path / "ours.gguf", TinySpec(extra_metadata={}))
    other = tmp_path / "other.gguf"
    other.write_bytes(ours.read_bytes().replace(b"diffusion-gemma", b"gemma3\0\0\0\0\0\0\0\0\0", 1))

    def no_full_parse(*a, **k):
        raise AssertionError("the whole GGUF was read")

    monkeypatch.setattr(source, "GGUFHeader", no_full_parse)
    with pytest.raises(ConvertError, match="general.architecture is 'gemma3"):
        source.open_gguf(other)


def test_bench_reports_a_missing_peer_once_with_how_to_install(tmp_path, monkeypatch, capsys):
    """Both mlx-vlm peers need the same package: one line, and the command that installs it.
    The measurements are replaced (this checks the report, not the timing)."""
    import argparse

    from mlx_dgemma import bench

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"canvas_length": 16}))
    calls = []

    def fake_isolated(fn_name, **kwargs):
        calls.append(fn_name)
        if fn_name == "measure_ours":
            return {"impl": f"mlx-dgemma {kwargs['precision']}", "precision": kwargs["precision"], "dtype": "float32",
                    "seconds_per_step": 1.0, "flops_per_step": 1e9, "prefill_tokens_per_second": 10.0,
                    "peak_rss_bytes": 1, "load_seconds": 0.1, "first_step_seconds": 1.0}
        return {"impl": fn_name, "missing": "mlx_vlm",
                "skipped": "not installed (mlx_vlm); install the peers with: pip install -e '.[parity,bench]'"}

    monkeypatch.setattr(bench, "isolated", fake_isolated)
    monkeypatch.setattr(bench, "build", lambda name, work, canvas: (tmp_path / "x.gguf", model_dir))
    monkeypatch.setattr(bench, "dense_matmul_gflops", lambda dt: 1.0)
    p = argparse.ArgumentParser()
    bench.add_args(p)
    args = p.parse_args(["--configs", "tiny", "--peers", "mlx-vlm,mlx-vlm-q4", "--extras", "none",
                         "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "b.json")])
    text = bench.table(bench.run(args))
    assert calls.count("measure_mlx_vlm") == 1
    lines = [ln for ln in text.splitlines() if "not installed" in ln]
    assert len(lines) == 1 and lines[0].startswith("mlx-vlm ") and "pip install -e '.[parity,bench]'" in lines[0]
