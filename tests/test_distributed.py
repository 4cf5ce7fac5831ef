"""Tensor parallelism (mlx_dgemma/distributed.py, DiffusionGemma.shard): two local ranks under
``mlx.launch --backend ring`` reproduce one process, and each rank's slices are the right ones.

Tolerance: the sharded model computes the same float32 math, but every all-reduce changes the
summation order of a dot product (two half sums added instead of one long sum) and the softmax
normalisers are summed per rank. That is the rounding that separates two float32
implementations of the same model, so the bound is the parity tests' one against transformers,
1e-5 of the largest logit (measured here: about 7e-7 on the trained demo).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_flatten

from mlx_dgemma import distributed, generate, load, load_demo
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.demo import trained_demo_path
from mlx_dgemma.distributed import Split, load_shards, param_slices, take
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import build_model
from mlx_dgemma.validate import check_model_dir, model_dir_shards

sys.path.insert(0, str(Path(__file__).parent))
import agree_worker  # noqa: E402
import distributed_worker  # noqa: E402
import lockstep_worker  # noqa: E402
from test_tui_quit import CANCELLED, CTRL_Q, ESCAPE, Terminal, ask, assert_clean_exit  # noqa: E402

TOL = 1e-5


def _free_ports() -> int:
    """A port P with P and P + 1 free on loopback: the ring's two ranks listen there. Not MLX's
    fixed default (32323), which two test runs on one machine at once would share, their ranks
    then meeting each other's."""
    import random
    import socket

    for _ in range(100):
        port = random.randint(20000, 59000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    return 32323


# `mlx.launch` (MLX's console script) with this interpreter, wherever the script was installed
LAUNCH = [sys.executable, "-c", "import sys; from importlib.metadata import entry_points; "
          "sys.exit(entry_points(group='console_scripts')['mlx.launch'].load()())",
          "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports()), "--"]

needs_ring = pytest.mark.skipif(not mx.distributed.is_available(), reason="this MLX build has no distributed backend")


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def launch(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    # mlx.launch exits 0 even when a rank fails: callers check the ranks' output
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "demo"
    convert(trained_demo_path(), out)
    return out


@needs_ring
def test_two_ranks_reproduce_one_process(demo_dir, tmp_path):
    """Per-rank loading from a converted directory, a 4-chunk prefill, logits with exact and
    top-k self-conditioning, and a seeded generation: 2 ranks against one process."""
    out = tmp_path / "ranks.npz"
    r = launch([sys.executable, distributed_worker.__file__, str(demo_dir), str(out)])
    assert out.is_file(), r.stdout + r.stderr
    got, meta = np.load(out), json.loads(Path(str(out) + ".json").read_text())
    ref = distributed_worker.run(str(demo_dir))
    assert meta["ranks"] == 2 and ref["ranks"] == 1 and meta["chunks"] == ref["chunks"] >= 3
    for name in ("first", "sc", "sc_top_k"):
        assert got[name].shape == ref[name].shape
        assert rel(got[name], ref[name]) <= TOL, name
    assert meta["text"] == ref["text"] and len(ref["text"]) > 20


@needs_ring
def test_two_ranks_reproduce_one_process_on_medium(tmp_path):
    """The benchmark's `medium` config (random Q4_K_M weights, 8 heads, 32 experts; canvas 32 to
    keep it short): per-rank loading, a multi-chunk prefill and the logits with and without
    self-conditioning, 2 ranks against one process (each pass to 1e-5 given the same input).
    Random weights are chaotic (a 1e-7 difference can flip a near-tie in the sampler), so the
    text is compared on the demo only."""
    from mlx_dgemma.bench.configs import build

    _, model_dir = build("medium", tmp_path, 32)
    out = tmp_path / "ranks.npz"
    r = launch([sys.executable, distributed_worker.__file__, str(model_dir), str(out), "--no-text"], timeout=600)
    assert out.is_file(), r.stdout + r.stderr
    got, meta = np.load(out), json.loads(Path(str(out) + ".json").read_text())
    ref = distributed_worker.run(str(model_dir), text=False)
    assert meta["ranks"] == 2 and meta["chunks"] == ref["chunks"] >= 3
    assert got["first"].shape == ref["first"].shape and rel(got["first"], ref["first"]) <= TOL
    # Each pass against one process's on the same input: the self-conditioned passes read the
    # first pass's logits, and on random weights the rounding of those (above) grows through
    # softmax and six layers (measured: the first pass 3.7e-6; the self-conditioned ones 4.4e-6
    # exact / 4.0e-6 top-k given the same input, 1.5e-5 / 8.2e-6 end to end).
    same_input = distributed_worker.run(str(model_dir), text=False, sc_input=got["first"])
    for name in ("sc", "sc_top_k"):
        assert got[name].shape == ref[name].shape
        assert rel(got[name], same_input[name]) <= TOL, (name, rel(got[name], same_input[name]))
        assert rel(got[name], ref[name]) <= 10 * TOL, (name, rel(got[name], ref[name]))


@needs_ring
def test_generate_cli_under_mlx_launch():
    """`mlx.launch -n 2 -- python -m mlx_dgemma generate --demo --json`: one JSON line (rank 0
    alone prints), "ranks": 2, and the text of one process with the same seed."""
    args = ["--prompt", "In the beginning", "--seed", "0", "--steps", "8", "--max-tokens", "64"]
    r = launch([sys.executable, "-m", "mlx_dgemma", "generate", "--demo", "--json", *args])
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout + r.stderr
    res = json.loads(lines[0])
    assert res["ranks"] == 2
    rt = load_demo()
    model, tok = rt.model, rt.tokenizer
    assert res["text"] == generate(rt, "In the beginning", seed=0, max_denoising_steps=8, max_new_tokens=64)


def test_chat_under_mlx_launch_needs_a_model(monkeypatch, capsys):
    """Rank 0's app cannot offer the demo later: the other ranks load what it loads, at start.
    One line, before any loading (MLX_RANK is what mlx.launch sets)."""
    from mlx_dgemma.cli import main

    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.delenv("MLX_DGEMMA_MODEL", raising=False)
    assert main(["chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs --model PATH or --demo" in err[0], err


def test_rank_terminal_refuses_a_rank_started_over_ssh(monkeypatch):
    """A hostfile's rank runs under ``ssh -tt``: its stdin is ssh's terminal, whose screen
    reaches the user only through the launcher's pipes. Refused in one line naming serve."""
    import pty

    from mlx_dgemma.launch import rank_terminal

    master, slave = pty.openpty()
    try:
        with open(slave, closefd=False) as tty_in:
            monkeypatch.setattr(sys, "stdin", tty_in)
            with pytest.raises(ParameterError, match="started over ssh.*serve"):
                with rank_terminal("chat"):
                    pytest.fail("entered without a terminal of its own")
    finally:
        os.close(master)
        os.close(slave)


@needs_ring
def test_chat_under_mlx_launch_without_a_terminal_refuses(tmp_path):
    """Rank 0 with no controlling terminal (a new session, pipes only): one line naming what to
    do instead, and no rank is left behind (the launcher returns)."""
    r = subprocess.run(LAUNCH + [sys.executable, "-m", "mlx_dgemma", "chat", "--demo"], capture_output=True,
                       text=True, timeout=120, start_new_session=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)})
    errors = sorted(ln for ln in r.stderr.splitlines() if "error:" in ln)
    assert len(errors) == 2 and errors[1].startswith("mlx-dgemma chat: error: chat under mlx.launch: rank 0 has no "
                                                      "terminal ("), r.stderr
    reason = errors[1].split("error: ", 1)[1]
    assert "`serve` under mlx.launch" in reason and "mlx.launch -n 2" in reason, reason
    # rank 1 learns it at its first agreement point, before loading anything
    assert errors[0] == f"[rank 1] mlx-dgemma chat: error: rank 0: {reason}", r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr, r.stderr


class LaunchedTerminal(Terminal):
    """``mlx.launch -n 2 -- python -m mlx_dgemma chat ...`` in a pseudo-terminal that is the
    launcher's controlling terminal, as a shell's terminal is (the ranks inherit it)."""

    def __init__(self, *args: str, rows: int = 30, cols: int = 120, env: dict | None = None):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", **(env or {})}
        env.pop("TEXTUAL", None)
        # a new session whose controlling terminal is the pty, then the launcher
        take_tty = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
        cmd = [sys.executable, "-c", take_tty, *LAUNCH[1:], sys.executable, "-m", "mlx_dgemma", *args]
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.out = bytearray()


@needs_ring
def test_chat_under_mlx_launch(tmp_path):
    """`mlx.launch -n 2 -- python -m mlx_dgemma chat --demo` from a terminal: rank 0's app draws
    on the launcher's terminal and gets its keys; rank 1 follows. An answer, Escape mid-answer,
    another answer (its steps run on both ranks: they are still in lockstep), Ctrl+Q during it:
    every rank ends (the launcher returns 0 only then), nothing but the app on the screen."""
    term = LaunchedTerminal("chat", "--demo", env={"MLX_DGEMMA_CACHE": str(tmp_path)})
    try:
        at = ask(term, "Who was Moses?")
        term.send(ESCAPE)
        at = term.wait_for(CANCELLED, at)
        term.send(b"And Aaron?\r")
        term.wait_for(re.compile(rb"step [2-9]\d*/\d+"), at)  # a second step: both ranks ran the first
        term.send(CTRL_Q)
        assert_clean_exit(term)
    finally:
        if term.proc.poll() is None:
            _kill_all(term.proc)
    text = term.text
    for bad in ("error", "Traceback", "WARN", "lost rank"):
        assert bad not in text, text[-1500:]


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes ``mlx.launch`` started (its children, by MLX_RANK): the
    children from ``ps`` (Linux and macOS), each one's MLX_RANK from Linux's /proc or, elsewhere,
    from ``ps -E`` (macOS shows a process's environment to its owner). Skips the test where
    neither tells."""
    children = _children(launcher)
    out = {}
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_text().replace("\0", " ")
        except OSError:
            env = subprocess.run(["ps", "-wwE", "-o", "command=", "-p", str(pid)], capture_output=True, text=True,
                                 timeout=30).stdout
        m = re.search(r"(?:^|\s)MLX_RANK=(\d+)(?:\s|$)", env)
        if m:
            out[int(m.group(1))] = pid
    if children and not out:
        pytest.skip("this system shows no other process's environment (mlx.launch's ranks are told apart by MLX_RANK)")
    return out


def _children(parent: int) -> list[int]:
    """The pids of ``parent``'s child processes (``ps``: Linux and macOS)."""
    ps = subprocess.run(["ps", "-axo", "pid=,ppid="], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid, ppid in (ln.split() for ln in ps.splitlines() if ln.strip()) if int(ppid) == parent]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return bool(state.strip()) and not state.strip().startswith("Z")


def _post(url: str, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _leave_stream(url: str, body: dict) -> None:
    """A streamed request whose client leaves after the first event: the server cancels it."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()
    conn.close()


SERVE_REQUESTS = [  # (path, body): seeded, one or two 64-token blocks of a few steps
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who was Moses?"}], "seed": 1,
                              "max_tokens": 64, "max_denoising_steps": 4}),
    # the stop string ends it after the first of two blocks: rank 0 stops iterating early
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who was Moses?"}], "seed": 1,
                              "max_tokens": 128, "max_denoising_steps": 4, "stop": ["I"]}),
    ("/v1/completions", {"prompt": "In the beginning", "seed": 2, "max_tokens": 64, "max_denoising_steps": 4}),
]
FOLLOW_UP = {"role": "user", "content": "And Aaron?"}


def _serve_answers(post) -> list[str]:
    """The requests' texts (``post(path, body) -> JSON``); after the first, a second turn that
    continues its conversation (the session is reused: cached tokens)."""
    texts = []
    for i, (path, body) in enumerate(SERVE_REQUESTS):
        c = post(path, body)["choices"][0]
        texts.append(c["message"]["content"] if "message" in c else c["text"])
        if i == 0:
            turn = {**body, "messages": [*body["messages"], {"role": "assistant", "content": texts[0]}, FOLLOW_UP]}
            r = post(path, turn)
            texts += [r["choices"][0]["message"]["content"], str(r["usage"]["prompt_tokens_details"]["cached_tokens"])]
    return texts


def _launch_serve(tmp_path: Path) -> tuple[subprocess.Popen, list[str]]:
    """`mlx.launch -n 2 -- python -m mlx_dgemma serve --demo --port 0`, once rank 0 listens;
    the launcher's stderr lines keep arriving in the list."""
    import os
    import re
    import threading

    env = {**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)}
    proc = subprocess.Popen(LAUNCH + [sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if re.search(r"on http://[\d.]+:\d+/v1", line):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or proc.poll() is not None:
        proc.kill()
        pytest.fail("serve did not start under mlx.launch:\n" + "".join(lines))
    return proc, lines


def _kill_all(proc: subprocess.Popen) -> None:
    import os
    import signal

    if proc.poll() is None:
        for p in _children(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


@needs_ring
def test_serve_under_mlx_launch(tmp_path, monkeypatch):
    """`mlx.launch -n 2 -- python -m mlx_dgemma serve --demo`: rank 0 serves, rank 1 follows it;
    seeded answers (a stop string mid-answer, a client that leaves mid-stream, a continued
    conversation, a completion) are those of a one-process server; SIGTERM to rank 0 ends both
    ranks (rank 1 by the shutdown rank 0 broadcasts)."""
    import os
    import re
    import signal

    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    proc, lines = _launch_serve(tmp_path)
    try:
        url = re.search(r"on (http://[\d.]+:\d+)/v1", "".join(lines)).group(1)
        # a client that leaves mid-stream first: rank 0 cancels, rank 1 must stop at the same step
        _leave_stream(url, {"messages": [{"role": "user", "content": "Speak"}], "seed": 5, "max_tokens": 192,
                            "max_denoising_steps": 4})
        got = _serve_answers(lambda path, body: _post(url, path, body))
        ranks = _rank_pids(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[0], signal.SIGTERM)
        # mlx.launch returns once every rank has ended: a follower left blocked would time this out
        assert proc.wait(30) == 0, "".join(lines)
        log = "".join(lines)
        assert "finish=cancelled" in log and "stopped" in log and "send/recv errors" not in log, log
    finally:
        _kill_all(proc)
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    with TestClient(create_app(Engine(demo=True))) as client:  # one process, the same requests
        ref = _serve_answers(lambda path, body: client.post(path, json=body).json())
    assert got == ref, (got, ref)
    assert int(got[2]) > 0 and all(len(t) > 3 for t in got[:2] + got[3:]), got


@needs_ring
@pytest.mark.slow  # reason: a third two-rank launch of the demo (~20 s); the clean stop is tested above
def test_serve_follower_leaves_when_rank_0_dies(tmp_path):
    """SIGKILL to rank 0 (no shutdown sent): rank 1's next collective fails, it says so in one
    line and exits, and the launcher returns; nothing is left blocked."""
    import os
    import signal

    proc, lines = _launch_serve(tmp_path)
    try:
        ranks = _rank_pids(proc.pid)
        os.kill(ranks[0], signal.SIGKILL)
        proc.wait(60)
        log = "".join(lines)
        assert "[rank 1] mlx-dgemma serve: error: lost rank 0" in log, log
        assert not _alive(ranks[1]), f"rank 1 (pid {ranks[1]}) is still running"
    finally:
        _kill_all(proc)


@needs_ring
def test_chat_jobs_in_lockstep_under_mlx_launch(tmp_path, monkeypatch):
    """The chat app's job sequence through ``ModelRuntime`` (rank 0) and its follower loop
    (rank 1): turns, an Escape after 2 steps, a turn its consumer leaves after 3, a new chat
    with a system prompt, shutdown. Every turn ends as in one process (text, steps, reason,
    and the session's state after it), and rank 1 leaves at the shutdown."""
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    out = tmp_path / "chat.json"
    r = launch([sys.executable, lockstep_worker.__file__, str(out)], timeout=180)
    assert out.is_file(), r.stdout + r.stderr
    got = json.loads(out.read_text())
    ref = lockstep_worker.run()
    assert got[-1] == {"ranks": 2} and ref[-1] == {"ranks": 1}
    assert got[:-1] == ref[:-1], (got, ref)
    # the paths were taken: Escape stopped turn 2 at step 2; turn 4 (left) did not happen
    assert [(t["reason"], t["steps"]) for t in ref[1:4]] == [("cancelled", 2), ("eos", 4), (None, 3)]
    assert ref[3]["history"] == 0 and ref[3]["messages"] == ref[2]["messages"] and ref[4]["messages"] == 3
    assert "send/recv errors" not in r.stderr, r.stderr


@needs_ring
def test_a_load_failing_on_one_rank_stops_every_rank():
    """Rank 1's load fails (a memory plan refusing on the smaller Mac): rank 0, loaded, does not
    go on alone into the first collective; every rank exits with one line, rank 0's naming
    rank 1 and its reason, and no traceback."""
    reason = "the model needs 9.0 GB but 4.0 GB is available on rank 1's Mac"
    r = launch([sys.executable, agree_worker.__file__, "load", "generate", "--demo", "--prompt", "Hi",
                "--max-tokens", "64"], timeout=180)
    errors = sorted(ln for ln in r.stderr.splitlines() if "error:" in ln)
    assert errors == [f"[rank 1] mlx-dgemma generate: error: {reason}",
                      f"mlx-dgemma generate: error: rank 1: {reason}"], r.stderr
    assert "Traceback" not in r.stderr and not r.stdout.strip(), r.stderr
    codes = re.findall(r"rank (\d) exited with code (-?\d+)", r.stderr)
    assert {rank for rank, code in codes if code != "0"} == {"0", "1"}, r.stderr


@needs_ring
def test_a_memory_check_failing_on_one_rank_keeps_the_ranks_in_lockstep(tmp_path, monkeypatch):
    """Rank 1's memory check of a prompt fails (rank 0's passes): the generation fails on every
    rank before any model collective (rank 0 names rank 1's reason), and the next one runs in
    lockstep and gives one process's text. Before, rank 1 skipped the generation while rank 0
    ran it: their collectives no longer matched (a hang, or a lost connection)."""
    from mlx_dgemma.lockstep import ModelRuntime

    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    out = tmp_path / "agree.json"
    r = launch([sys.executable, agree_worker.__file__, "fits", str(out)], timeout=180)
    assert out.is_file(), r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["error"] == ["MemoryBudgetError",
                            "rank 1: this prompt needs 9.0 GB but 4.0 GB is available on rank 1's Mac"], got
    ref = [ev.text for ev in ModelRuntime(load_demo()).generate(agree_worker.PROMPT, **agree_worker.PARAMS)
           if type(ev).__name__ == "DoneEvent"]
    assert got["text"] == ref and len(ref[0]) > 3, (got, ref)


def _unloaded(model_dir: Path):
    return build_model(check_model_dir(model_dir))


def _full_shapes(model) -> dict:
    full = {p: {k: tuple(v.shape) for k, v in m.parameters().items() if isinstance(v, mx.array)}
            for p, m in model.named_modules()}
    return {p: s for p, s in full.items() if s}


def test_rank_slices_read_from_disk_are_the_full_tensors_slices(all_types_model_dir):
    """Every ggml type (padded 16-element sub-blocks included): what a rank reads from the files
    equals slicing the fully loaded tensor, and the two ranks' parts cover it."""
    full_model = load(all_types_model_dir, precision="exact").model
    full = dict(tree_flatten(full_model.parameters()))
    files = model_dir_shards(all_types_model_dir)
    parts = []
    for rank in range(2):
        model = _unloaded(all_types_model_dir)
        shapes = _full_shapes(model)
        plan = model.shard_plan(2, rank)
        weights = dict(load_shards(model, files, shapes, plan))
        assert set(weights) == set(full)
        modules = dict(model.named_modules())
        for path, split in plan.items():
            for pname, (axis, ranges) in param_slices(modules[path], split, shapes[path]).items():
                name = f"{path}.{pname}"
                assert mx.array_equal(weights[name], take(full[name], axis, ranges)).item(), name
        parts.append(weights)
    q = "layers.0.self_attn.q_proj.weight"
    assert parts[0][q].shape[0] + parts[1][q].shape[0] == full[q].shape[0]
    assert not mx.array_equal(parts[0][q], parts[1][q]).item()


def test_padded_input_split_sums_to_the_full_product(all_types_model_dir):
    """A quantized layer split along its input (o_proj, down_proj) with padded 16-element
    sub-blocks: the two ranks' partial products add up to the whole layer's output."""
    model = load(all_types_model_dir, precision="exact").model
    padded = [(p, m) for p, m in model.named_modules()
              if getattr(m, "subblock", 32) == 16 and p.endswith(("o_proj", "down_proj")) and "experts" not in p]
    assert padded, "the all-types model has no padded input-split layer"
    path, m = padded[0]
    n_in = m.weight.shape[-1] * 32 // m.bits // 2
    x = mx.random.normal((3, n_in), key=mx.random.key(1))
    whole = m(x)
    total = mx.zeros_like(whole)
    for rank in range(2):
        lo, hi = distributed.even(n_in, 2, rank, "features")
        part = type(m)(hi - lo, m.weight.shape[0], m.bits, m.subblock, m.group_size)
        shapes = {k: tuple(v.shape) for k, v in m.parameters().items()}
        for name, (axis, ranges) in param_slices(m, Split("in", ((lo, hi),)), shapes).items():
            setattr(part, name, take(m[name], axis, ranges))
        total = total + part(x[:, lo:hi])
    assert rel(np.array(total), np.array(whole)) <= TOL


def test_split_that_cuts_heads_or_groups_is_refused(tiny_model_dir):
    model = _unloaded(tiny_model_dir)  # 2 query heads
    with pytest.raises(ParameterError, match="ranks"):
        model.shard_plan(3, 0)
    m = model.layers[0].self_attn.o_proj
    shapes = {k: tuple(v.shape) for k, v in m.parameters().items()}
    with pytest.raises(ParameterError, match="quantization group"):
        param_slices(m, Split("in", ((0, 8),)), shapes)
