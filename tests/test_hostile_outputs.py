"""Issue 29's hostile rerun of what commands write and refuse (items 1, 5, 6, 7): an output
path is never one of the command's inputs, never turns a FIFO or a device into a regular file;
standard output closed or full and standard error full are a line, not a traceback, and cost
no answer; empty and absurd values are refused, not ignored; the errors blame the right thing.
Each case failed on main ``d82e233``."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from mlx_dgemma.cli import main
from tests.hostile_util import promise
from tests.test_hostile_rerun import _edit_config, _poison_safetensors

# one step a block: the commit guard (which would re-roll such blocks) off, as in the other mechanics tests
GEN = ["--prompt", "hi", "--seed", "0", "--steps", "1", "--max-tokens", "32", "--commit-entropy", "0"]


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("MLX_DGEMMA_MODEL", raising=False)
    monkeypatch.delenv("MLX_DGEMMA_API_KEY", raising=False)
    return tmp_path


@pytest.fixture
def gguf(work, tiny_gguf) -> Path:
    """A model file of the test's own (it is what a wrong --trace would destroy)."""
    return Path(shutil.copy(tiny_gguf, work / "m.gguf"))


def _refused(argv, capsys, work, keep, *words) -> str:
    code, line = promise(argv, capsys, work, keep)
    assert code == 2, line
    for w in words:
        assert w in line, line
    return line


# --------------------------------------------------------------------------- 1: outputs over inputs

@pytest.mark.parametrize("spelling", ["plain", "dot", "symlink", "hardlink"])
def test_trace_onto_the_model_file_is_refused_before_any_work(work, gguf, capsys, monkeypatch, spelling):
    # before: the 1.6 MB GGUF was replaced by a 2.6 KB trace (a 17 GB download, the same typo)
    monkeypatch.chdir(work)
    trace = {"plain": str(gguf), "dot": "./m.gguf", "symlink": "link.gguf", "hardlink": "hard.gguf"}[spelling]
    if spelling == "symlink":
        os.symlink(gguf, work / "link.gguf")
    if spelling == "hardlink":
        os.link(gguf, work / "hard.gguf")
    before = gguf.read_bytes()
    keep = {"m.gguf", "link.gguf", "hard.gguf"}
    _refused(["generate", "--model", str(gguf), *GEN, "--trace", trace], capsys, work, keep,
             "--trace", "is the input file", "give another file name")
    assert gguf.read_bytes() == before
    assert spelling != "symlink" or (work / "link.gguf").is_symlink()


def test_trace_onto_the_prompt_file_is_refused(work, gguf, capsys):
    prompt = work / "p.txt"
    prompt.write_text("hello")
    _refused(["generate", "--model", str(gguf), "--prompt-file", str(prompt), "--seed", "0", "--steps", "1",
              "--trace", str(prompt)], capsys, work, {"m.gguf", "p.txt"}, "is the input file", str(prompt))
    assert prompt.read_text() == "hello"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_trace_inside_the_converted_model_directory_is_refused(work, tiny_model_dir, capsys, name):
    d = Path(shutil.copytree(tiny_model_dir, work / "m"))
    before = (d / name).read_bytes()
    _refused(["generate", "--model", str(d), *GEN, "--trace", str(d / name)], capsys, work, {"m"},
             "is inside the input directory", str(d))
    assert (d / name).read_bytes() == before


def test_trace_onto_the_demo_model_is_refused(work, capsys):
    from mlx_dgemma.demo import trained_demo_path

    demo = trained_demo_path()
    size = demo.stat().st_size
    _refused(["generate", "--demo", *GEN, "--trace", str(demo)], capsys, work, set(), "is the input file")
    assert demo.stat().st_size == size


def test_trace_onto_the_file_standard_output_goes_to_is_refused(work, tiny_model_dir):
    # `generate --trace out.txt > out.txt`: the rename left the answer in a deleted file
    out = work / "out.txt"
    with open(out, "w") as f:
        r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "generate", "--model", str(tiny_model_dir), *GEN,
                            "--trace", str(out)], stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is this command's standard output" in r.stderr.strip().splitlines()[-1]


def _fifo_reader(path: Path) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as f:  # blocks until the command opens the FIFO to write
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


def test_trace_into_a_fifo_is_written_in_place(work, tiny_model_dir, capsys):
    # before: the FIFO was replaced by a regular file (its reader waited forever)
    fifo = work / "trace.fifo"
    os.mkfifo(fifo)
    reader, got = _fifo_reader(fifo)
    assert main(["generate", "--model", str(tiny_model_dir), *GEN, "--trace", str(fifo)]) == 0
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    records = [json.loads(line) for line in got[0].decode().splitlines()]
    assert records[0]["record"] == "header" and len(records) > 1
    assert sorted(p.name for p in work.iterdir()) == ["trace.fifo"]  # no temporary left beside it


def test_trace_through_a_link_to_a_device_keeps_the_link(work, tiny_model_dir, capsys):
    # /dev/null as the user gives it, through a link in a directory of the test's own: before, the
    # rename replaced the link with a regular file (and /dev/null itself, as root)
    link = work / "null"
    os.symlink(os.devnull, link)
    assert main(["generate", "--model", str(tiny_model_dir), *GEN, "--trace", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == os.devnull
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert sorted(p.name for p in work.iterdir()) == ["null"]


def test_trace_through_a_link_to_a_file_replaces_the_file_and_keeps_the_link(work, tiny_model_dir, capsys):
    (work / "traces").mkdir()
    target = work / "traces" / "t.jsonl"
    target.write_text("old\n")
    os.symlink(target, work / "latest.jsonl")
    assert main(["generate", "--model", str(tiny_model_dir), *GEN, "--trace", str(work / "latest.jsonl")]) == 0
    assert (work / "latest.jsonl").is_symlink()
    assert json.loads(target.read_text().splitlines()[0])["record"] == "header"
    assert sorted(p.name for p in (work / "traces").iterdir()) == ["t.jsonl"]


def test_a_socket_is_refused_as_an_output(work, tiny_model_dir, capsys):
    import socket

    path = work / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        _refused(["generate", "--model", str(tiny_model_dir), *GEN, "--trace", str(path)], capsys, work,
                 {"s.sock"}, "is a socket or a block device")


def _bench_args(work: Path, *extra: str):
    from mlx_dgemma.cli import build_parser

    argv = ["bench", "--configs", "tiny", "--peers", "none", "--extras", "none", "--workdir", str(work / "w"),
            *extra]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("victim", ["tiny-c256.gguf", "tiny-c256/config.json"])
def test_bench_json_onto_its_own_random_model_is_refused(work, victim):
    # before: every row's rewrite replaced the cached GGUF (or the converted config) with the JSON
    from mlx_dgemma.bench import check_args
    from mlx_dgemma.errors import ParameterError

    (work / "w" / "tiny-c256").mkdir(parents=True)
    (work / "w" / victim).write_text("model")
    with pytest.raises(ParameterError) as e:
        check_args(_bench_args(work, "--json", str(work / "w" / victim)))
    assert str(e.value).startswith("--json ") and "input" in str(e.value)
    assert (work / "w" / victim).read_text() == "model"


def test_bench_json_into_a_fifo_is_written_once_at_the_end(work):
    from mlx_dgemma.bench import JsonWriter, check_args

    fifo = work / "b.fifo"
    os.mkfifo(fifo)
    plan = check_args(_bench_args(work, "--json", str(fifo)))
    writer = JsonWriter(plan.json)
    writer({"rows": 1})  # a row finished: a regular file is rewritten; a FIFO waits for the end
    reader, got = _fifo_reader(fifo)
    writer({"rows": 2}, final=True)
    reader.join(30)
    assert json.loads(got[0]) == {"rows": 2} and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_bench_e2e_json_onto_its_model_is_refused(work, gguf, capsys):
    # before: the models ran (minutes), then the JSON replaced the GGUF (or failed on a bad path)
    _refused(["bench", "--e2e", "--e2e-models", str(gguf), "--json", str(gguf)], capsys, work, {"m.gguf"},
             "--json", "is the input file")


@pytest.mark.parametrize("report, words", [("MODEL", ["is the input file"]), ("", ["--report ''", "an empty path"])])
def test_doctor_report_onto_its_model_or_empty_is_refused_before_any_check(work, gguf, capsys, report, words):
    # before: the report replaced the GGUF after every check; '' was taken as no report
    before = gguf.read_bytes()
    code = main(["doctor", "--quick", "--model", str(gguf), "--report", str(gguf) if report == "MODEL" else report])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("[doctor")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("mlx-dgemma doctor: error: --report "), err
    assert all(w in lines[0] for w in words) and out == "" and "demo" not in err
    assert gguf.read_bytes() == before


async def test_chat_trace_export_into_a_missing_directory_is_a_notice(work):
    # before: the export's ParameterError was not an OSError: the app crashed with a traceback
    from mlx_dgemma.tui.app import DGemmaApp
    from tests.tui_helpers import SIZE, ask, wait_for
    from tests.tui_fakes import ScriptedBackend

    backend = ScriptedBackend(steps=2, blocks=1)
    app = DGemmaApp(backend, trace_dir=work / "gone")
    notes: list[str] = []
    real_notify = app.notify
    app.notify = lambda message, **kw: (notes.append(str(message)), real_notify(message, **kw))  # type: ignore
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: any("Export failed" in n for n in notes))
    assert app.last_export is None and any("does not exist" in n for n in notes)


# --------------------------------------------------------------------------- 5: tracebacks

HUGE = "9" * 400


@pytest.mark.parametrize("argv", [
    ["plan", "--demo", "--memory-limit", HUGE],
    ["generate", "--demo", "--prompt", "hi", "--memory-limit", HUGE],
    ["serve", "--demo", "--memory-limit", HUGE],  # refused before it listens
])
def test_a_400_digit_memory_limit_is_refused(work, capsys, argv):
    # before: OverflowError: cannot convert float infinity to integer
    _refused(argv, capsys, work, set(), "--memory-limit", "larger than any machine's memory")


@pytest.mark.parametrize("key, value", [
    ("mlx_dgemma", "q4"), ("mlx_dgemma", [1]), ("mlx_dgemma", None),  # before: AttributeError ('str' ... 'get')
    ("mlx_dgemma.weights", "q2"), ("mlx_dgemma.weights", 3),  # before: loaded as exact, verified "all exact"
])
@pytest.mark.parametrize("command", ["verify", "generate", "plan"])
def test_a_bad_mlx_dgemma_section_in_config_json_is_named(work, tiny_model_dir, tiny_gguf, capsys, command, key,
                                                          value):
    d = Path(shutil.copytree(tiny_model_dir, work / "m"))
    if key == "mlx_dgemma":
        _edit_config(d, lambda c: c.update(mlx_dgemma=value))
    else:
        _edit_config(d, lambda c: c["mlx_dgemma"].update(weights=value))
    argv = {"verify": ["verify", str(d), str(tiny_gguf)], "generate": ["generate", "--model", str(d), *GEN],
            "plan": ["plan", str(d)]}[command]
    _refused(argv, capsys, work, {"m"}, str(d / "config.json"), f"{key} = ", "expected")


class _Full(io.StringIO):
    """A stream on a full disk: every write and flush fails as /dev/full does."""

    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("argv", [
    ["plan", "--demo"],
    ["generate", "--model", "MODEL", *GEN],
    ["generate", "--model", "MODEL", *GEN, "--json"],
    ["verify", "MODEL", "GGUF"],
    ["doctor", "--quick", "--json"],
])
def test_standard_output_on_a_full_disk_is_one_line(work, tiny_model_dir, tiny_gguf, capsys, monkeypatch, argv):
    # before: OSError: [Errno 28] No space left on device, a traceback, exit 1
    argv = [str(tiny_model_dir) if a == "MODEL" else str(tiny_gguf) if a == "GGUF" else a for a in argv]
    monkeypatch.setattr(sys, "stdout", _Full())
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"mlx-dgemma {argv[0]}: error: standard output: cannot write (No space "
                                            "left on device); free some space or send it elsewhere")


def test_convert_with_a_full_standard_output_keeps_and_names_the_conversion(work, tiny_gguf, capsys, monkeypatch):
    # before: the whole conversion ran, then a traceback; the directory is complete: say so
    monkeypatch.setattr(sys, "stdout", _Full())
    line = _refused(["convert", str(tiny_gguf), str(work / "out")], capsys, work, {"out"},
                    "standard output: cannot write", "the conversion itself is complete", str(work / "out"))
    assert "conversion_report.json" in line and (work / "out" / "config.json").is_file()


@pytest.mark.parametrize("argv", [["plan", "--demo"], ["generate", "--demo", *GEN], ["verify", "M", "G"],
                                  ["doctor", "--quick"], ["convert", "G", "OUT"]])
def test_a_closed_standard_output_is_refused_before_any_work(work, capsys, monkeypatch, argv):
    # Python leaves sys.stdout None when descriptor 1 is closed (>&-); before: AttributeError
    # ('NoneType' object has no attribute 'flush'/'write'/'isatty'), convert after converting
    argv = [str(work / "out") if a == "OUT" else a for a in argv]
    monkeypatch.setattr(sys, "stdout", None)
    _refused(argv, capsys, work, set(), "standard output is closed", ">/dev/null")


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_dgemma", *argv], stderr=subprocess.PIPE, text=True,
                          timeout=300, **kw)


def test_a_closed_standard_output_for_real(work, gguf):
    r = _run(["convert", str(gguf), str(work / "out")], stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "mlx-dgemma convert: error: standard output is closed (>&-); what the command prints would be lost, or "
        "land in a file it opens: send it somewhere, e.g. >/dev/null"]
    assert not (work / "out").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_dev_full_for_real(work, tiny_model_dir):
    with open("/dev/full", "w") as full:
        r = _run(["generate", "--model", str(tiny_model_dir), *GEN], stdout=full)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("mlx-dgemma generate: error: standard output: cannot write (No "
                                                 "space left on device); free some space or send it elsewhere")
    with open("/dev/full", "w") as full:  # standard error full: the answer still arrives, exit 0
        r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "generate", "--model", str(tiny_model_dir), *GEN,
                            "--json"], stdout=subprocess.PIPE, stderr=full, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["finish_reason"]


def test_standard_error_on_a_full_disk_keeps_the_answer(work, tiny_model_dir, capsys, monkeypatch):
    # before: the first progress line ("[prefill] ...") raised OSError, the answer never printed
    from mlx_dgemma.text import printable

    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--raw", "--seed", "1", "--steps", "4",
            "--max-tokens", "64"]
    assert main([*argv, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert text  # an answer to lose
    monkeypatch.setattr(sys, "stderr", _Full())
    assert main(argv) == 0
    assert capsys.readouterr().out == printable(text) + "\n"


# --------------------------------------------------------------------------- 6: accepted silently

@pytest.mark.parametrize("argv, words", [
    (["plan", "--demo", "--memory-limit", ""], ["--memory-limit ''", "expected a size"]),
    (["generate", "--demo", "--prompt", "hi", "--memory-limit", ""], ["--memory-limit ''", "expected a size"]),
    (["plan", "--demo", "--memory-limit", "0.0000001B"], ["--memory-limit '0.0000001B'", "less than one byte"]),
    (["generate", "--demo", "--prompt", "hi", "--trace", ""], ["--trace ''", "an empty path"]),
    (["generate", "--demo", "--prompt", "hi", "--trace", " "], ["--trace ' '", "an empty path"]),
])
def test_empty_and_vanishing_values_are_refused(work, capsys, argv, words):
    # before: '' ignored (no limit, no trace), 0.0000001B a 0-byte limit ("nothing fits")
    _refused(argv, capsys, work, set(), *words)


def _serve_flags(**kw):
    import argparse

    base = dict(queue_size=1, max_body_mb=1.0, max_request_steps=1, max_request_seconds=None, max_connections=1, parallel=1,
                header_timeout=1.0, body_timeout=1.0, api_key=None, cors=None, allowed_hosts=None, host="127.0.0.1",
                port=8080)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("port", [-1, 65536, 99999])
def test_serve_refuses_a_port_out_of_range_before_loading(port):
    # before: the model loaded, then bind()'s own words ("port must be 0-65535.") in a sentence about --host
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.server.cli import check_args

    with pytest.raises(ParameterError) as e:
        check_args(_serve_flags(port=port))
    assert str(e.value) == f"--port {port}: must be a port number in [0, 65535] (0 picks a free one)"
    check_args(_serve_flags(port=0))  # a free port: allowed


@pytest.mark.parametrize("host", ["", "  "])
def test_serve_refuses_an_empty_host(host):
    # before: bind("") listened on every interface
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.server.cli import check_args

    with pytest.raises(ParameterError) as e:
        check_args(_serve_flags(host=host))
    assert str(e.value).startswith(f"--host {host!r}: an empty address") and "0.0.0.0" in str(e.value)


@pytest.mark.parametrize("value", ["", "   "])
def test_serve_refuses_an_empty_api_key_variable(monkeypatch, value):
    # before: an empty $MLX_DGEMMA_API_KEY started the server with no key and no word
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.server.cli import check_args

    monkeypatch.setenv("MLX_DGEMMA_API_KEY", value)
    with pytest.raises(ParameterError) as e:
        check_args(_serve_flags())
    assert str(e.value).startswith("$MLX_DGEMMA_API_KEY: empty") and "unset MLX_DGEMMA_API_KEY" in str(e.value)


def test_serve_takes_the_api_key_variable_and_the_flag_before_it(monkeypatch):
    from mlx_dgemma.server.cli import check_args

    monkeypatch.setenv("MLX_DGEMMA_API_KEY", "from-env")
    args = _serve_flags()
    check_args(args)
    assert args.api_key == "from-env"
    args = _serve_flags(api_key="flag")
    check_args(args)
    assert args.api_key == "flag"


def test_serve_refuses_an_empty_host_from_the_command_line(work, capsys):
    # the whole path: refused before the memory plan, the model and the socket
    _refused(["serve", "--demo", "--host", ""], capsys, work, set(), "--host ''", "an empty address")


# --------------------------------------------------------------------------- 7: misleading

def test_doctor_blames_the_model_not_the_device_for_nan_weights(work, tiny_model_dir):
    # before: "This device computes the model wrongly at the failing precision"
    from mlx_dgemma.doctor import run_doctor

    d = Path(shutil.copytree(tiny_model_dir, work / "m"))
    _poison_safetensors(d, "norm.weight", None)
    report = run_doctor(str(d), cases=(), layers=1)
    assert not report.ok and report.failed and all(c.model_fault for c in report.failed)
    result = report.lines()[-1]
    assert "not this device" in result and "weights are broken" in result and "wrongly" not in result
    assert any("norm.weight" in c.detail for c in report.failed)
    assert report.to_json()["checks"][1]["model_fault"] is True


def test_doctor_still_blames_the_device_when_the_reference_is_finite(work, tiny_model_dir):
    from mlx_dgemma.doctor import run_doctor

    def corrupt(quantity, a):
        return a + 1.0 if quantity == "logits" else a

    report = run_doctor(str(tiny_model_dir), cases=(), layers=1, perturb=corrupt)
    assert [c.check for c in report.failed] == ["logits"] and not report.failed[0].model_fault
    assert "this device computes the model wrongly" in report.lines()[-1]


def _nan_scale_gguf(src: Path, dst: Path, tensor: str = "blk.0.ffn_gate_up_exps.weight") -> Path:
    """A copy of ``src`` whose first block of ``tensor`` (Q4_K: the scale d first) is NaN."""
    from mlx_dgemma.convert.scan import scan_gguf

    data = bytearray(src.read_bytes())
    offset = next(t.offset for t in scan_gguf(src, None).tensors if t.name == tensor)
    data[offset:offset + 2] = np.float16(np.nan).tobytes()
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("precision", ["q4", "q3"])
def test_nan_scales_re_quantized_are_a_corrupt_file_not_a_range(work, tiny_gguf, capsys, precision):
    # before: "a group's scale or offset exceeds float16's range (max |value| nan); convert it with
    # --precision exact", and exact then said the file is corrupt
    src = _nan_scale_gguf(tiny_gguf, work / "m.gguf")
    line = _refused(["convert", str(src), str(work / "out"), "--precision", precision], capsys, work, {"m.gguf"},
                    "'blk.0.ffn_gate_up_exps.weight'", "NaN or Inf", "corrupt")
    assert "float16" not in line and "--precision exact" not in line


@pytest.mark.parametrize("value", ["-inf", "-1e-300", "-.5e1", "-nan"])
def test_negative_looking_values_reach_the_flags_own_check(work, capsys, value):
    # before: argparse's "argument --accept-probability: expected one argument"
    _refused(["generate", "--model", str(work / "nope"), "--prompt", "hi", "--accept-probability", value], capsys,
             work, set(), f"error: --accept-probability {float(value)}: must be a probability in [0, 1]")


def test_a_negative_number_is_still_a_prompt(work, tiny_model_dir, capsys, monkeypatch):
    import mlx_dgemma.generation

    seen = []
    real = mlx_dgemma.generation.stream_generate

    def spying(runtime, prompt, **kw):
        seen.append(prompt)
        yield from real(runtime, prompt, **kw)

    monkeypatch.setattr(mlx_dgemma.generation, "stream_generate", spying)
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "-1e3", "--steps", "1", "--max-tokens", "32",
                 "--json"]) == 0
    assert seen == ["-1e3"]


@pytest.mark.parametrize("argv", [["convert", "", "OUT"], ["convert", " ", "OUT"], ["verify", "", "GGUF"],
                                  ["verify", "MODEL", ""]])
def test_an_empty_model_path_is_named_as_such(work, tiny_model_dir, tiny_gguf, capsys, argv):
    # before: ".: is a directory, not a file" / ".: config.json is missing" (Path("") is ".")
    argv = [str(work / "out") if a == "OUT" else str(tiny_gguf) if a == "GGUF" else str(tiny_model_dir)
            if a == "MODEL" else a for a in argv]
    line = _refused(argv, capsys, work, set(), "an empty path")
    assert ": error: '" in line and "directory, not" not in line and "missing" not in line


def test_bench_refuses_an_empty_workdir(work):
    # before: '' became the current directory, silently filled with random models
    from mlx_dgemma.bench import check_args
    from mlx_dgemma.errors import ParameterError

    args = _bench_args(work)
    args.workdir = ""
    with pytest.raises(ParameterError, match=r"^--workdir '': an empty path"):
        check_args(args)


def test_an_empty_prompt_file_path_is_named_as_such(work, capsys):
    # before: "--prompt-file : is a directory, not a file" (Path("") is ".")
    line = _refused(["generate", "--demo", "--prompt-file", ""], capsys, work, set(), "--prompt-file ''",
                    "an empty path")
    assert "directory" not in line


@pytest.mark.parametrize("case", ["missing", "config-dir", "file"])
def test_verify_says_what_the_directory_is(work, tiny_model_dir, tiny_gguf, capsys, case):
    # before: "no config.json" for a directory that does not exist and for a config.json directory
    d = work / "m"
    if case == "config-dir":
        shutil.copytree(tiny_model_dir, d)
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    if case == "file":
        d.write_text("x")
    words = {"missing": [f"{d}: no such file or directory"],
             "config-dir": [f"{d / 'config.json'}: is a directory, not a file"],
             "file": [f"{d}: is a file, not a directory"]}[case]
    line = _refused(["verify", str(d), str(tiny_gguf)], capsys, work, {"m"}, *words)
    assert "no config.json" not in line


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_the_trace_header_records_the_prompt_read(work, tiny_model_dir, capsys, monkeypatch, source):
    # before: "prompt": null with --prompt-file, "-" with --prompt -
    text = "Why is the sky blue?\né"
    (work / "p.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8"))
    given = ["--prompt-file", str(work / "p.txt")] if source == "file" else ["--prompt", "-"]
    assert main(["generate", "--model", str(tiny_model_dir), *given, "--seed", "0", "--steps", "1", "--max-tokens",
                 "32", "--trace", str(work / "t.jsonl")]) == 0
    header = json.loads((work / "t.jsonl").read_text().splitlines()[0])
    assert header["prompt"] == text and header["model"] == str(tiny_model_dir)
