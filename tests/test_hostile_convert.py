"""Hostile paths, signals and races around ``convert``: --force never removes what it did not
write, signals and stale temporaries leave nothing, an input changing underneath is an error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_dgemma.cli import main
from mlx_dgemma.convert import source


def run(capsys, *args) -> tuple[int, str]:
    code = main(["convert", *map(str, args)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("converting", "\r"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.fixture
def src(tmp_path, tiny_gguf) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    p = d / "in.gguf"
    p.write_bytes(tiny_gguf.read_bytes())
    return p


def test_force_onto_the_input_file_keeps_it(src, capsys):
    before = src.read_bytes()
    code, line = run(capsys, src, src, "--force")
    assert code == 2 and "input" in line and str(src) in line
    assert src.is_file() and src.read_bytes() == before


def test_force_onto_a_directory_holding_the_input_keeps_everything(src, capsys):
    (src.parent / "notes.txt").write_text("mine")
    code, line = run(capsys, src, src.parent, "--force")
    assert code == 2 and "contains the input" in line
    assert src.is_file() and (src.parent / "notes.txt").read_text() == "mine"


def test_output_inside_the_input_file(src, capsys):
    code, line = run(capsys, src, src / "out")
    assert code == 2 and "inside the input" in line
    assert sorted(p.name for p in src.parent.iterdir()) == ["in.gguf"]


def test_force_refuses_a_directory_it_did_not_make(src, tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    code, line = run(capsys, src, other, "--force")
    assert code == 2 and "not written by mlx-dgemma convert" in line
    assert (other / "cat.jpg").read_bytes() == b"\xff\xd8"


def test_force_refuses_a_file(src, tmp_path, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    code, line = run(capsys, src, other, "--force")
    assert code == 2 and "not a directory" in line
    assert other.read_text() == "mine"


def test_force_replaces_its_own_output(src, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["convert", str(src), str(out)]) == 0
    (out / "config.json").write_text("{}")  # still ours: the report marks it
    assert main(["convert", str(src), str(out), "--force"]) == 0
    assert "model_type" in (out / "config.json").read_text()
    capsys.readouterr()


def test_force_keeps_a_users_file_put_in_its_own_output(src, tmp_path, capsys):
    # --force replaces the whole directory: a file the user put in it would go with it, silently
    out = tmp_path / "m"
    assert main(["convert", str(src), str(out)]) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    before = sorted(p.name for p in out.iterdir())
    code, line = run(capsys, src, out, "--force")
    assert code == 2 and line.endswith(f"{out}: also holds notes.txt, sub, which mlx-dgemma convert did not write; "
                                       "--force replaces the whole directory: move them out first, or choose "
                                       "another path"), line
    assert sorted(p.name for p in out.iterdir()) == before and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / "sub").rmdir()
    (out / ".DS_Store").write_bytes(b"Bud1")  # a Mac's Finder's, not the user's: no reason to refuse
    assert main(["convert", str(src), str(out), "--force"]) == 0
    capsys.readouterr()


def test_an_empty_directory_made_beforehand_is_used(src, tmp_path, capsys, monkeypatch):
    # mkdir ~/models/dgemma first is common; an empty directory holds nothing to lose (no --force)
    out = tmp_path / "made"
    out.mkdir()
    assert main(["convert", str(src), str(out)]) == 0
    capsys.readouterr()
    assert (out / "config.json").is_file() and (out / "conversion_report.json").is_file()
    code, line = run(capsys, src, out)  # not empty now: our own output, replaced only with --force
    assert code == 2 and "already exists" in line
    # the current directory (or a mount point) cannot be renamed: the files move into it
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["convert", str(src), "."]) == 0
    capsys.readouterr()
    assert (here / "config.json").is_file() and (here / "conversion_report.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside it


@pytest.mark.parametrize("kind", ["dir", "fifo", "dev", "loop"])
def test_input_that_is_not_a_regular_file(tmp_path, capsys, kind):
    p = tmp_path / "in.gguf"
    if kind == "dir":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev":
        p = Path("/dev/zero")
    else:
        p.symlink_to(tmp_path / "loop2")
        (tmp_path / "loop2").symlink_to(p)
    code, line = run(capsys, p, tmp_path / "out")
    assert code == 2 and str(p) in line and "no such file" not in line
    assert not (tmp_path / "out").exists()


def test_long_output_name(src, tmp_path, capsys):
    ok = tmp_path / ("m" * 245)
    assert main(["convert", str(src), str(ok)]) == 0 and (ok / "config.json").is_file()
    code, line = run(capsys, src, tmp_path / ("n" * 256))
    assert code == 2 and "too long" in line
    capsys.readouterr()


def test_stale_partial_of_a_dead_process_is_removed(src, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".m.partial-{dead.pid}"
    stale.mkdir()
    (stale / "shard-1.tmp").write_bytes(b"x" * 100)
    assert main(["convert", str(src), str(tmp_path / "m")]) == 0
    assert not stale.exists()
    capsys.readouterr()


def test_input_truncated_during_conversion(src, tmp_path, capsys, monkeypatch):
    real = source.convert_tensor
    calls = {"n": 0}

    def convert_tensor(t, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # another process cuts the file while we read it
            os.truncate(src, src.stat().st_size // 2)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(source, "convert_tensor", convert_tensor)
    code, line = run(capsys, src, tmp_path / "m")
    assert code == 2 and str(src) in line and "changed" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


_SLOW_CONVERT = """
import sys, time
from mlx_dgemma.convert import source
real = source.convert_tensor
def slow(t, *args, **kwargs):
    time.sleep(0.05)
    return real(t, *args, **kwargs)
source.convert_tensor = slow
from mlx_dgemma.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_terminating_signals_clean_up(src, tmp_path, sig):
    out = tmp_path / "m"
    p = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, "convert", str(src), str(out)],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not any(x.name.startswith(".m.partial-") for x in tmp_path.iterdir()):
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err and "nothing partial" in err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["models"]
