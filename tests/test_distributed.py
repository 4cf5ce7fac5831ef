"""Tensor parallelism (mlx_dgemma/distributed.py, DiffusionGemma.shard): two local ranks under
``mlx.launch --backend ring`` reproduce one process, and each rank's slices are the right ones.

Tolerance: the sharded model computes the same float32 math, but every all-reduce changes the
summation order of a dot product (two half sums added instead of one long sum) and the softmax
normalisers are summed per rank. That is the rounding that separates two float32
implementations of the same model, so the bound is the parity tests' one against transformers,
1e-5 of the largest logit (measured here: about 7e-7 on the trained demo).
"""

from __future__ import annotations

import json
import subprocess
import sys
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
import distributed_worker  # noqa: E402
import lockstep_worker  # noqa: E402

TOL = 1e-5
# `mlx.launch` (MLX's console script) with this interpreter, wherever the script was installed
LAUNCH = [sys.executable, "-c", "import sys; from importlib.metadata import entry_points; "
          "sys.exit(entry_points(group='console_scripts')['mlx.launch'].load()())",
          "-n", "2", "--backend", "ring", "--"]

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


def test_chat_refuses_several_ranks(monkeypatch, capsys):
    """One line naming the command and what to use instead, before any loading (the group is
    stubbed: starting one needs mlx.launch; the launch tests above cover a real one)."""
    from mlx_dgemma.cli import main

    class TwoRanks:
        def size(self) -> int:
            return 2

    monkeypatch.setattr(distributed, "world", lambda: TwoRanks())
    monkeypatch.setenv("MLX_RANK", "0")  # what mlx.launch sets: the command line looks for a group only then
    assert main(["chat", "--demo"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs in one process" in err[0] and "generate" in err[0], err


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes ``mlx.launch`` started (its children, by MLX_RANK)."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                out[int(env["MLX_RANK"])] = int(d.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


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
        for p in _rank_pids(proc.pid).values():
            os.kill(p, signal.SIGKILL)
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
        assert not Path(f"/proc/{ranks[1]}/cmdline").exists() or not Path(f"/proc/{ranks[1]}/cmdline").read_bytes()
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
