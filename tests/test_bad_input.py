"""Bad input: one-line error naming the file and tensor, non-zero exit, nothing left behind."""

import errno
import shutil
from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as T

from mlx_dgemma.cli import main
from mlx_dgemma.convert import converter, source, writer
from mlx_dgemma.errors import DGemmaError
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf


def run_cli(capsys, *args):
    code = main(["convert", *map(str, args)])
    err = capsys.readouterr().err
    return code, err


def assert_clean(parent, allowed=()):
    left = sorted(p.name for p in parent.iterdir() if p.name not in allowed)
    assert left == [], f"left behind: {left}"


def one_line(err):
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("converting", "\r", "["))]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def work(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    return tmp_path


def test_not_a_gguf(work, capsys):
    bad = work / "in" / "model.gguf"
    bad.write_bytes(b"<html>not found</html>")
    code, err = run_cli(capsys, bad, work / "out" / "m")
    assert code == 2
    line = one_line(err)
    assert str(bad) in line and "not a GGUF" in line
    assert_clean(work / "out")


def test_missing_file(work, capsys):
    code, err = run_cli(capsys, work / "in" / "nope.gguf", work / "out" / "m")
    assert code == 2 and "no such file" in one_line(err)


def test_a_download_folder_given_as_the_model_names_its_gguf(work, capsys, tiny_gguf):
    # `--model ~/Downloads/dgemma` (the folder `hf download --local-dir` filled) said only that
    # config.json is missing
    folder = work / "in"
    shutil.copy(tiny_gguf, folder / "m.gguf")
    assert main(["generate", "--model", str(folder), "--prompt", "hi"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.endswith(f"{folder}: not a converted directory (config.json is missing), but it holds m.gguf; "
                         f"give that file: {folder / 'm.gguf'}"), line


def test_truncated_file(work, capsys, tiny_gguf):
    cut = work / "in" / "cut.gguf"
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, cut, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and str(cut) in line and "truncated" in line
    assert_clean(work / "out")


def test_wrong_architecture(work, capsys):
    spec = TinySpec(extra_metadata={})
    path = write_tiny_gguf(work / "in" / "llama.gguf", spec)
    raw = path.read_bytes().replace(b"diffusion-gemma", b"diffusion-gemmX", 1)
    path.write_bytes(raw)
    code, err = run_cli(capsys, path, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "general.architecture" in line and "diffusion-gemma" in line


def test_missing_tensor(work, capsys):
    path = write_tiny_gguf(work / "in" / "m.gguf", drop=("blk.1.ffn_up.weight",))
    code, err = run_cli(capsys, path, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "'blk.1.ffn_up.weight' is missing" in line and "[256, 256]" in line
    assert_clean(work / "out")


def test_unexpected_shape(work, capsys):
    # Tensors written for a dense width of 288, metadata then edited to claim 256.
    path = write_tiny_gguf(work / "in" / "m.gguf", replace(TinySpec(), intermediate_size=288),
                           types="f32")
    data = path.read_bytes()
    key = b"diffusion-gemma.feed_forward_length"
    i = data.index(key) + len(key) + 4  # the key, then its uint32 value type
    path.write_bytes(data[:i] + (256).to_bytes(4, "little") + data[i + 4:])
    code, err = run_cli(capsys, path, work / "out" / "m")
    line = one_line(err)
    assert code == 2
    assert "'self_cond_down.weight' has shape [288, 256], expected [256, 256]" in line
    assert_clean(work / "out")


def test_unknown_tensor(work, capsys):
    import numpy as np

    path = write_tiny_gguf(work / "in" / "m.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    code, err = run_cli(capsys, path, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "unexpected tensor 'blk.0.mystery.weight'" in line and "blk.N.attn_q.weight" in line


def test_unsupported_type(work, capsys):
    path = write_tiny_gguf(work / "in" / "m.gguf", types={"token_embd.weight": T.IQ4_NL})
    code, err = run_cli(capsys, path, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "'token_embd.weight'" in line and "IQ4_NL" in line and "supported" in line
    assert_clean(work / "out")


def test_output_exists(work, capsys, tiny_gguf):
    out = work / "out" / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, tiny_gguf, out)
    assert code == 2 and "already exists" in one_line(err) and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_no_disk_space_up_front(work, capsys, tiny_gguf, monkeypatch):
    monkeypatch.setattr(converter.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    code, err = run_cli(capsys, tiny_gguf, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "not enough disk space" in line
    assert_clean(work / "out")


def test_disk_full_while_writing(work, capsys, tiny_gguf, monkeypatch):
    calls = {"n": 0}
    real_add = writer.ShardWriter.add

    def add(self, name, a):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, a)

    monkeypatch.setattr(writer.ShardWriter, "add", add)
    code, err = run_cli(capsys, tiny_gguf, work / "out" / "m")
    line = one_line(err)
    assert code == 2 and "no space left" in line
    assert_clean(work / "out")


def test_interrupted_conversion_leaves_nothing(work, tiny_gguf, monkeypatch):
    real = source.convert_tensor
    calls = {"n": 0}

    def convert_tensor(t, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 30:
            raise KeyboardInterrupt
        return real(t, *args, **kwargs)

    monkeypatch.setattr(source, "convert_tensor", convert_tensor)
    assert main(["convert", str(tiny_gguf), str(work / "out" / "m")]) == 130
    assert_clean(work / "out")


def test_debug_shows_traceback(work, tiny_gguf):
    with pytest.raises(DGemmaError):  # the early path check (before the converter's imports) or convert's own
        main(["--debug", "convert", str(work / "in" / "missing.gguf"), str(work / "out" / "m")])
