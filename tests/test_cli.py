"""The command line as a user meets it (issues 20 and 24): what `generate` reads and prints
(stdin, --prompt-file, the step line on a terminal, --json tokens, blocks counted from 1),
MLX_DGEMMA_MODEL for every command, paths that are not model files, the help texts, Ctrl+C
at any moment, and an instant start (no MLX, mlx-lm, transformers, torch or Textual imported
for help, version, argument and missing-file errors)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_dgemma.generation
from mlx_dgemma.cli import build_parser, main
from mlx_dgemma.events import BlockEvent, DoneEvent, StepEvent

HEAVY = ("mlx", "mlx_lm", "transformers", "torch", "textual")
# one block of the demo (canvas 64) that ends at its end-of-turn marker (seed 0), in few steps
DEMO_RUN = ["generate", "--demo", "--prompt", "Hi", "--seed", "0", "--steps", "4", "--max-tokens", "128"]


@pytest.fixture
def spy(monkeypatch):
    """Every stream_generate call the CLI makes: its prompt and the events it yielded."""
    calls: list[dict] = []
    real = mlx_dgemma.generation.stream_generate

    def spying(runtime, prompt, **kw):
        call = {"prompt": prompt, "events": [], "runtime": runtime}
        calls.append(call)
        for ev in real(runtime, prompt, **kw):
            call["events"].append(ev)
            yield ev

    monkeypatch.setattr(mlx_dgemma.generation, "stream_generate", spying)
    return calls


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("MLX_DGEMMA_MODEL", raising=False)


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("loading", "\r", "["))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------- generate's output


def test_json_tokens_are_the_answer_only(spy, capsys, clean_env):
    assert main([*DEMO_RUN, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    done = [ev for ev in spy[0]["events"] if isinstance(ev, DoneEvent)][0]
    eos = set(spy[0]["runtime"].generation_config["eos_token_id"])
    assert out["finish_reason"] == "eos"
    end = next(i for i, t in enumerate(done.tokens) if t in eos)  # the end-of-turn marker
    assert out["tokens"] == list(done.tokens[:end])  # neither the marker nor the pads after it
    assert len(done.tokens) > end + 1  # (the run did produce both: the test can tell)


def test_blocks_count_from_1(spy, capsys, clean_env, tmp_path):
    assert main([*DEMO_RUN, "--show-drafts", "--trace", str(tmp_path / "t.jsonl")]) == 0
    events = spy[0]["events"]
    steps = [ev for ev in events if isinstance(ev, StepEvent)]
    blocks = [ev for ev in events if isinstance(ev, BlockEvent)]
    assert steps[0].block == 1 and steps[0].step == 1 and blocks[0].block == 1
    assert {s.block for s in steps} == {b.block for b in blocks} == set(range(1, len(blocks) + 1))
    assert "[block 1 step  1]" in capsys.readouterr().err  # --show-drafts shows the event's number
    header, *records = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert header["record"] == "header"
    assert [(r["block"], r["step"]) for r in records] == [(s.block, s.step) for s in steps]


def test_show_drafts_says_when_a_guard_re_rolls_a_block(spy, capsys, clean_env):
    # the demo's canvases do not converge in 2 steps: the commit guard re-rolls the block; the
    # drafts started again at step 1 with no word of why
    assert main(["generate", "--demo", "--prompt", "Hi", "--seed", "0", "--steps", "2", "--max-tokens", "64",
                 "--show-drafts"]) == 0
    steps = [ev for ev in spy[0]["events"] if isinstance(ev, StepEvent)]
    retried = [ev for ev in steps if ev.attempt > 1 and ev.step == 1]
    assert retried, "no re-roll on this run: the test cannot tell"
    err = capsys.readouterr().err
    for ev in retried:
        assert f"[block {ev.block}] re-rolled with a new key (attempt {ev.attempt})" in err
    assert err.count("re-rolled with a new key") == len(retried)


def test_trace_header_records_the_sc_top_k_in_effect(capsys, clean_env, tmp_path):
    """fast self-conditions from the top 64 tokens unless asked otherwise; the header said null."""
    from mlx_dgemma.precision import FAST_SC_TOP_K

    def header(*flags: str) -> dict:
        path = tmp_path / "t.jsonl"
        assert main([*DEMO_RUN, "--steps", "2", "--max-tokens", "64", "--trace", str(path), *flags]) == 0
        capsys.readouterr()
        return json.loads(path.read_text().splitlines()[0])

    fast = header()
    assert fast["precision"].startswith("fast") and fast["settings"]["sc_top_k"] == FAST_SC_TOP_K
    assert header("--precision", "exact")["settings"]["sc_top_k"] is None  # the whole vocabulary
    assert header("--sc-top-k", "16")["settings"]["sc_top_k"] == 16  # the request wins


def test_step_line_on_a_terminal_only(spy, capsys, monkeypatch, clean_env):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(DEMO_RUN) == 0
    err = capsys.readouterr().err
    steps = [ev for ev in spy[0]["events"] if isinstance(ev, StepEvent)]
    lines = re.findall(r"\r\x1b\[2K\[block (\d+) \(max (\d+)\) step (\d+)/(\d+)\] accepted \d+/64, H=[\d.]+", err)
    assert [(int(b), int(s)) for b, _, s, _ in lines] == [(ev.block, ev.step) for ev in steps]  # one per step
    assert {(n_blocks, n_steps) for _, n_blocks, _, n_steps in lines} == {("2", "4")}  # 128 tokens: 2 blocks
    assert err.index("[prefill]") < err.index("\r\x1b[2K[block 1 (max 2) step 1/4]")
    assert re.search(r"H=[\d.]+\r\x1b\[2K\[done\]", err)  # erased before the summary (and the answer)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([*DEMO_RUN, "--json"]) == 0  # --json: nothing but the JSON and errors
    assert "step 1/" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(DEMO_RUN) == 0  # not a terminal (logs, pipes): no step lines
    assert "\r" not in capsys.readouterr().err


# --------------------------------------------------------------------------- where the prompt comes from


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("json_out", [True, False])
def test_max_tokens_counts_tokens_not_blocks(json_out, spy, capsys, clean_env):
    # before: --max-tokens 10 printed the whole first block (27 tokens), the server's max_tokens cut at 10
    argv = ["generate", "--demo", "--prompt", "In the beginning", "--seed", "0", "--steps", "3",
            "--commit-entropy", "0", "--max-tokens", "4"]
    assert main([*argv, *(["--json"] if json_out else [])]) == 0
    out, err = capsys.readouterr()
    done = [ev for ev in spy[0]["events"] if isinstance(ev, DoneEvent)][0]
    pad = spy[0]["runtime"].generation_config["pad_token_id"]
    assert sum(t != pad for t in done.tokens) > 4  # the core made a whole block: the cut is the CLI's
    kept, counted = [], 0  # the first 4 tokens that are not padding, counted here (not by max_tokens_cut)
    for t in done.tokens:
        if counted == 4:
            break
        kept.append(t)
        counted += t != pad
    tok = spy[0]["runtime"].tokenizer
    from mlx_dgemma.chat_template import parse_answer

    text = parse_answer(tok.decode(kept)).answer
    if json_out:
        got = json.loads(out)
        assert got["tokens"] == [t for t in kept if t != pad][:4] and len(got["tokens"]) <= 4
        assert got["text"] == text and got["finish_reason"] == "length"
    else:
        assert out.rstrip("\n") == text and "[done] length" in err


def test_max_tokens_cut_counts_no_padding():
    from mlx_dgemma.sampler import max_tokens_cut

    assert max_tokens_cut([5, 0, 6, 7], 2, 0) == 3  # 5, (pad), 6
    assert max_tokens_cut([5, 6], 2, 0) == 2 and max_tokens_cut([5, 6, 7], None, 0) == 3
    assert max_tokens_cut([0, 0, 0], 1, 0) == 3  # padding alone: nothing to cut


def test_a_context_overflow_names_the_flag(capsys, clean_env):
    # before: "... shorten the prompt or max_new_tokens" (the parameter, not the flag typed)
    assert main(["generate", "--demo", "--prompt", "hi", "--max-tokens", "20000"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "exceed the context of" in line and line.endswith("shorten the prompt or --max-tokens"), line


@pytest.mark.parametrize("argv", [["--prompt", "-"], ["--prompt-file", "-"], ["--prompt-file", "FILE"]])
def test_prompt_from_stdin_or_a_file(argv, spy, capsys, monkeypatch, tmp_path, clean_env):
    text = "Why is the sky blue?\nAnswer in one line: é"
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    _stdin(monkeypatch, text.encode())
    argv = [str(tmp_path / "p.txt") if a == "FILE" else a for a in argv]
    assert main(["generate", "--demo", *argv, "--seed", "0", "--steps", "1", "--max-tokens", "64", "--json"]) == 0
    assert spy[0]["prompt"] == text


@pytest.mark.parametrize("argv, expected", [
    (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file /nonexistent/p.txt: no such file or directory"),
    (["--prompt-file", "/dev/zero"], "--prompt-file /dev/zero: is not a regular file"),
    (["--prompt-file", "DIR"], ": is a directory, not a file"),
    (["--prompt-file", "BAD"], "is not valid UTF-8 (byte b'\\xe9' at offset 3)"),
    (["--prompt", "-", "--prompt-file", "x"], None),  # argparse: not allowed together (exit 2)
])
def test_prompt_source_errors(argv, expected, capsys, tmp_path, clean_env):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    argv = [str(tmp_path) if a == "DIR" else str(tmp_path / "bad.txt") if a == "BAD" else a for a in argv]
    if expected is None:
        with pytest.raises(SystemExit) as e:
            main(["generate", "--demo", *argv])
        assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
        return
    assert main(["generate", "--demo", *argv]) == 2
    assert expected in one_line(capsys.readouterr().err)


# --------------------------------------------------------------------------- which model


def test_generate_uses_mlx_dgemma_model(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("MLX_DGEMMA_MODEL", str(tiny_model_dir))
    assert main(["generate", "--prompt", "hi", "--seed", "0", "--steps", "1", "--max-tokens", "32", "--json",
                 "--commit-entropy", "0"]) == 0  # one step never converges: no re-roll
    assert json.loads(capsys.readouterr().out)["steps"] == 1


def test_serve_uses_mlx_dgemma_model(tiny_model_dir, monkeypatch, capsys):
    import mlx_dgemma.server

    seen = []
    monkeypatch.setattr(mlx_dgemma.server, "main", lambda args: seen.append(args.model) or 0)
    monkeypatch.setenv("MLX_DGEMMA_MODEL", str(tiny_model_dir))
    assert main(["serve"]) == 0 and seen == [str(tiny_model_dir)]
    assert main(["serve", "--demo"]) == 0 and seen[-1] is None  # --demo wins over the environment
    assert "not DiffusionGemma's weights" in capsys.readouterr().err  # serve --demo says what it serves


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_no_model_error_mentions_the_environment(command, capsys, clean_env):
    assert main(command) == 2
    assert "MLX_DGEMMA_MODEL" in one_line(capsys.readouterr().err)


def _hostile_path(kind: str, tmp_path: Path) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return str(tmp_path / "fifo")
    if kind == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        return str(tmp_path / "a")
    return "/dev/zero"


@pytest.mark.parametrize("kind, expected", [("device", "is not a regular file (a FIFO, socket or device)"),
                                            ("fifo", "is not a regular file (a FIFO, socket or device)"),
                                            ("loop", "cannot open it (Too many levels of symbolic links)")])
@pytest.mark.parametrize("how", ["generate", "serve", "env"])
def test_model_paths_that_are_not_models(kind, expected, how, tmp_path, monkeypatch, capsys, clean_env):
    path = _hostile_path(kind, tmp_path)
    if how == "env":
        monkeypatch.setenv("MLX_DGEMMA_MODEL", path)
        argv = ["generate", "--prompt", "hi"]
    else:
        argv = [how, "--model", path] + (["--prompt", "hi"] if how == "generate" else [])
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{path}{' (from MLX_DGEMMA_MODEL)' if how == 'env' else ''}: {expected}" in line
    assert "no such file" not in line


def test_load_names_a_device_for_what_it_is():
    from mlx_dgemma import load
    from mlx_dgemma.errors import ModelFilesError

    with pytest.raises(ModelFilesError, match="/dev/zero: is not a regular file"):
        load("/dev/zero")


def test_config_json_that_is_a_directory(tiny_model_dir, tmp_path, capsys, clean_env):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    assert main(["generate", "--model", str(d), "--prompt", "hi"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{d / 'config.json'}: is a directory, not a file" in line and "missing" not in line


# --------------------------------------------------------------------------- help


def test_help_texts(capsys):
    parser = build_parser()
    top = parser.format_help()
    commands = parser._subparsers._group_actions[0].choices
    for name in commands:
        assert name in parser.description, name  # the description names every command, serve included
    assert "serve" in top and "first time?" in top
    assert commands["bench"].description and commands["serve"].description
    generate = commands["generate"].format_help()
    assert "--max-tokens N" in generate and "MAX_NEW_TOKENS" not in generate
    assert "MAX_DENOISING_STEPS" not in generate and "--prompt-file PATH" in generate


@pytest.mark.parametrize("flag", ["--bogus", "--max-token"])  # unknown, and a prefix of --max-tokens
def test_an_unknown_flag_gets_its_commands_usage_and_no_abbreviation_runs(capsys, flag):
    # before: `--max-token 5` ran as --max-tokens 5 (argparse's abbreviations), and an unknown flag
    # got the top-level usage (`mlx-dgemma [-h] ... COMMAND`), which lists none of generate's flags
    with pytest.raises(SystemExit) as e:
        main(["generate", "--demo", "--prompt", "hi", flag, "5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"mlx-dgemma generate: error: unrecognized arguments: {flag} 5" in err
    assert "usage: mlx-dgemma generate" in err


def test_bare_command_prints_the_first_time_text(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "first time?" in err and "mlx-dgemma chat --demo" in err and "serve" in err


# --------------------------------------------------------------------------- Ctrl+C, instant start


def _run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "mlx_dgemma", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv, env, code", [
    (["--version"], None, 0),
    (["--help"], None, 0),
    (["generate", "--help"], None, 0),
    (["chat", "--help"], None, 0),
    ([], None, 2),
    (["generate", "--model", "/nonexistent/m.gguf", "--prompt", "hi"], None, 2),
    (["generate", "--demo", "--prompt", "hi", "--steps", "0"], None, 2),
    (["generate", "--demo", "--prompt", "hi", "--bogus"], None, 2),
    (["generate", "--prompt", "hi"], {"MLX_DGEMMA_MODEL": "/nonexistent/m"}, 2),
    (["serve", "--model", "/nonexistent/m.gguf"], None, 2),
    (["chat", "--model", "/nonexistent/m.gguf"], None, 2),
    (["convert", "/nonexistent/m.gguf", "/tmp/mlx-dgemma-never-written"], None, 2),
    (["plan"], {"MLX_DGEMMA_MODEL": ""}, 2),
    # no terminal (stderr is a pipe here): refused before Textual and MLX (5-14 s, issue 30)
    (["chat", "--demo"], None, 2),
    # exact is float32: the contradiction is refused before MLX (7.8 s, issue 30)
    (["generate", "--demo", "--prompt", "hi", "--precision", "exact", "--dtype", "bfloat16"], None, 2),
    (["chat", "--demo", "--precision", "exact", "--dtype", "float16"], None, 2),
    (["serve", "--demo", "--precision", "exact", "--dtype", "bfloat16"], None, 2),
])
def test_instant_start_imports_nothing_heavy(argv, env, code):
    r = _run(argv, env)
    imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert r.returncode == code, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert heavy == [], heavy


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6])
def test_ctrl_c_early_is_one_line(delay, tmp_path):
    """SIGINT ``delay`` seconds after our code starts (the CLI module is imported): while the
    parser is built and the server's options are imported, or while the model loads. Exit 130,
    not death by SIGINT (``python -m``'s CPython quirk, see ``__main__``), not a PanicException
    from pydantic-core's import, not a server that starts anyway."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mlx_dgemma", "serve", "--demo", "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)})
    try:
        lines = []
        for line in proc.stderr:  # "import time: ... | mlx_dgemma.cli" is printed as main() begins
            lines.append(line)
            if line.rstrip().endswith("| mlx_dgemma.cli"):
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:  # bounded: an interrupt lost on the way means a server that runs on (a hang)
            _, rest = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"SIGINT {delay}s after the CLI started was lost: the server still ran 60 s later")
        code = proc.returncode
    finally:
        proc.kill()
    err = [ln for ln in rest.splitlines() if not ln.startswith("import time:")]
    assert "Traceback" not in rest and code == 130, rest[-3000:]
    assert err[-1].endswith(": interrupted; nothing partial was kept"), err
    assert len([ln for ln in err if not ln.startswith(("[demo]", "loading"))]) == 1, err


def test_progress_eta_only_when_meaningful(monkeypatch):
    """convert's bar said "~6187.4s left" a second in: now no estimate until 2 % and 2 s are
    done, then m:ss (h:mm:ss past an hour)."""
    import mlx_dgemma.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    bar = progress.ProgressBar("converting", stream=out)
    now[0] += 1.0
    bar.update(0.16e9, 100e9)  # 0.16 % after 1 s
    now[0] += 59.0
    bar.update(10e9, 100e9)  # 10 % after 60 s: 9 minutes left
    now[0] += 3540.0
    bar.update(20e9, 100e9)  # 20 % after 1 h: 4 h left
    first, second, third = out.getvalue().splitlines()
    assert "left" not in first and "0:01 elapsed, estimating" in first
    assert "1:00 elapsed, ~9:00 left" in second
    assert "1:00:00 elapsed, ~4:00:00 left" in third


def test_the_bar_stays_on_one_line_of_a_narrow_terminal(monkeypatch):
    # a wrapped bar leaves a line behind at every redraw ("\r" clears only its last row)
    import io

    import mlx_dgemma.progress as progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for cols in (80, 40, 200):
        monkeypatch.setattr(progress, "columns", lambda stream, cols=cols: cols)
        out = Terminal()
        bar = progress.ProgressBar("converting", stream=out)
        bar.update(0.5e9, 2e9, "blk.29.ffn_gate_up_exps.weight (Q4_K -> 4-bit groups of 128, 507 M weights)")
        drawn = out.getvalue().split("\r\x1b[2K")[-1]
        assert drawn.startswith("[##") and "] converting  25.0%" in drawn, (cols, drawn)
        assert len(drawn) <= cols - 1, (cols, drawn)
    assert len(drawn) > 120  # a wide terminal shows the whole note (the old cut was 120 characters)


def test_a_closed_pipe_is_a_quiet_stop(tiny_gguf):
    """`mlx-dgemma plan M | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "plan", str(tiny_gguf)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `head` does once it has its line (here: before any)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
