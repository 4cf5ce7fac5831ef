"""`mlx-dgemma serve` under clients that could stall it or that it could mislead (issue 23):
no request stalls the others (F1-F3), the queue counts and logs truthfully (F5-F7), errors
name the right thing (F8, F10), max_tokens is capped to what fits (F9), hostile input and
signals (issue 24). Each test here failed on the single-module server it replaces.

Live tests use their own server (demo model, free port, small limits); requests go over raw
HTTP, one connection each. Unit tests drive the engine's checks without a model."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest

from mlx_dgemma.host import ModelInfo
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.server.engine import Engine, Limits
from mlx_dgemma.server.errors import ContextLengthError
from mlx_dgemma.server.openai import Answer
from tests.test_server import LiveServer, _Tok, _add, wait_for

C = "/v1/chat/completions"
HOLD = {"max_denoising_steps": 40, "stability_threshold": 10_000, "commit_entropy": 0, "max_tokens": 64}  # holds the worker ~40 steps (no early commit)


class Server(LiveServer):
    """A LiveServer with extra flags."""

    def __init__(self, tmp: str, *flags: str):
        env = {**os.environ, "MLX_DGEMMA_CACHE": tmp}
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self.url = None
        import threading

        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()


def post(srv: LiveServer, body: dict, path: str = C) -> tuple[int, dict, Any]:
    return srv.raw("POST", path, json.dumps(body))


def msg(text: str = "hi", **kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_denoising_steps": 1, "max_tokens": 8, **kw}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("demo")), "--queue-size", "2", "--max-body-mb", "2",
               "--max-request-steps", "400", "--max-connections", "12", "--header-timeout", "1",
               "--body-timeout", "2", "--parallel", "1")
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def send_raw_request(srv: LiveServer, body: dict) -> socket.socket:
    data = json.dumps(body)
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(f"POST {C} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return sock


def health(srv: LiveServer) -> dict:
    return srv.raw("GET", "/health")[2]


def idle(srv: LiveServer) -> None:
    assert wait_for(lambda: (lambda h: not h["busy"] and h["queued"] == 0)(health(srv)), 120)


# --------------------------------------------------------------------------- F1, F8: size before tokens


def _engine(context: int = 4096, max_token_bytes: int = 17) -> Engine:
    """An engine with no model: what the request checks read, and a tokenizer that must not run."""
    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("tokenized an over-long prompt")

    e = Engine(demo=True, limits=Limits(max_request_steps=4096))
    e.tokenizer = SimpleNamespace(encode=never, chat_template=None, tokens=["x"])
    e.model = SimpleNamespace(args=SimpleNamespace(vocab_size=4096))
    e.max_token_bytes = max_token_bytes
    # the facts a load gives the host (the engine reads canvas, context and defaults from them)
    e.host.info = ModelInfo(name="test", precision="exact (float32)", demo=None, canvas_length=64,
                            context_length=context, vocab_size=4096,
                            generation_config=MappingProxyType({"max_new_tokens": 64, "max_denoising_steps": 48}))
    return e


def test_overlong_prompt_is_refused_by_its_size_before_tokenizing():
    e = _engine()
    big = "word " * 20_000  # 100 kB: at least 100000 / 17 > 4096 tokens whatever the tokenizer does
    with pytest.raises(ContextLengthError) as err:
        e.prepare_chat([{"role": "user", "content": big}], False, GenerationRequest())
    assert err.value.status == 400 and err.value.param == "messages" and "bytes" in err.value.message
    # the limit that applies is the context's (4096 tokens of at most 17 bytes), not the template's 4M characters
    assert "maximum context length is 4096 tokens" in err.value.message and "at most 69632 bytes" in err.value.message
    with pytest.raises(ContextLengthError) as err:
        e.prepare_completion(big, GenerationRequest())
    assert err.value.param == "prompt"


def test_a_message_beyond_the_template_budget_is_named_not_the_template():
    from mlx_dgemma.chat_template import RENDER_CHARS

    e = _engine(context=10**9, max_token_bytes=1)  # a context the bytes alone do not rule out
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * (RENDER_CHARS + 1)}]
    with pytest.raises(ContextLengthError) as err:
        e.prepare_chat(msgs, False, GenerationRequest())
    assert err.value.param == "messages[1].content" and "template" in err.value.message
    assert "loops" not in err.value.message  # F8: not blamed on the chat template


def test_huge_prompt_does_not_stall_health(srv):
    t0 = time.perf_counter()
    status, _, body = post(srv, {"messages": [{"role": "user", "content": "x" * (1900 << 10)}]})
    assert status == 400 and body["error"]["param"] == "messages" and "bytes" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"
    assert srv.raw("GET", "/health")[0] == 200
    assert time.perf_counter() - t0 < 30


# --------------------------------------------------------------------------- F2: silent clients, connection limit


def test_silent_connections_are_closed_and_make_room_for_newcomers(srv):
    idle(srv)
    silent = [socket.create_connection((srv.host, srv.port)) for _ in range(20)]  # over --max-connections 12
    try:
        for s in silent:
            s.settimeout(10)
        # over the limit, the oldest (they asked nothing) are closed without a word to make room;
        # the others after --header-timeout 1: every one ends, none holds its place
        assert all(s.recv(65536) == b"" for s in silent)
    finally:
        for s in silent:
            s.close()
    assert srv.raw("GET", "/health")[0] == 200
    room = [ln for ln in srv.lines if "to make room" in ln and "connection" in ln]
    assert 1 <= len(room) <= 2, room  # rate-limited: not one line per connection


def test_stalled_body_is_answered_408(srv):
    sock = socket.create_connection((srv.host, srv.port))
    try:
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n{\"messages\"".encode())
        sock.settimeout(15)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data, data
    finally:
        sock.close()


# --------------------------------------------------------------------------- F3: the work budget, HEAD


def test_work_budget_caps_the_blocks_and_refuses_only_a_block_beyond_it(srv):
    status, _, body = post(srv, msg(max_denoising_steps=10_000, stability_threshold=10_000, max_tokens=4032))
    assert status == 400 and body["error"]["param"] == "max_denoising_steps", body
    assert body["error"]["code"] == "work_budget_exceeded" and "--max-request-steps" in body["error"]["message"]
    # more blocks than the budget pays for: capped like the context caps them (was a 400 to a
    # client's default max_tokens)
    e = _engine()  # a budget of 4096 steps
    request = GenerationRequest.of({"max_new_tokens": 4032, "max_denoising_steps": 64})
    assert e.fit(10, request) == request  # 63 blocks x 64 steps fit
    request = GenerationRequest.of({"max_new_tokens": 4032, "max_denoising_steps": 128})
    assert e.fit(10, request)["max_new_tokens"] == 32 * 64


def test_head_on_get_routes(srv):
    for path in ("/health", "/v1/models", "/v1/models/mlx-dgemma-demo"):
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request("HEAD", path)
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"", path
        conn.close()


# --------------------------------------------------------------------------- F5, F6, F7: the queue


def test_refusals_are_logged_at_once_and_cancelled_waiters_free_their_place(srv):
    idle(srv)
    holder = send_raw_request(srv, msg("hold the worker", **HOLD))
    try:
        assert wait_for(lambda: health(srv)["busy"], 30)
        waiters = [send_raw_request(srv, msg(f"waiting {i}")) for i in range(2)]
        assert wait_for(lambda: health(srv)["queued"] == 2, 30)
        n = len(srv.request_lines())
        status, headers, body = post(srv, msg("one too many"))
        assert status == 503 and body["error"]["code"] == "server_busy"
        # F5: the 503 is logged now, not when some unrelated job ends
        assert wait_for(lambda: any(" 503 " in ln for ln in srv.request_lines()[n:]), 5), srv.lines[-5:]
        assert health(srv)["busy"]  # the holder still runs
        # F7: a place frees when the running job ends: no more than its whole length
        assert 1 <= int(headers["retry-after"]) <= 60
        # F6: waiters that left free their places at once, though the worker has not reached them
        for w in waiters:
            w.close()
        assert wait_for(lambda: health(srv)["queued"] == 0, 10)
        assert health(srv)["busy"]
        socks = [send_raw_request(srv, msg(f"after {i}")) for i in range(2)]
        assert wait_for(lambda: health(srv)["queued"] == 2, 10)  # both accepted, none refused
        for s in socks:
            s.close()
    finally:
        holder.close()
    idle(srv)


def test_retry_after_counts_what_the_running_job_has_left():
    e = _engine()
    e._durations.extend([4.0, 4.0, 4.0])
    e.worker.current = SimpleNamespace(started=time.perf_counter() - 3.0, cancelled=False)
    assert e.retry_after() == 1  # a 4 s job 3 s in: a place frees in about 1 s
    e.worker.current = None
    assert e.retry_after() == 2  # idle (a full queue about to start): half a job


# --------------------------------------------------------------------------- F9, F10


def test_max_tokens_beyond_what_fits_is_capped_with_length(srv):
    # a prompt of 3900 tokens leaves 3 blocks of the demo's 4096: max_tokens 4096 (a common client
    # default) is capped to them, not refused
    body = {"prompt": [5] * 3900, "max_tokens": 4096, "max_denoising_steps": 1, "commit_entropy": 0}  # no re-roll
    status, _, answer = post(srv, body, "/v1/completions")
    assert status == 200, answer
    u = answer["usage"]
    assert u["prompt_tokens"] == 3900 and u["completion_tokens"] <= 3 * 64
    assert answer["choices"][0]["finish_reason"] == "length" or u["completion_tokens"] < 3 * 64


def test_schedule_error_quotes_this_models_defaults(srv):
    status, _, body = post(srv, msg(t_min=0.9, t_max=0.5))
    assert status == 400 and "0.05 and 0.25" in body["error"]["message"] and "0.4" not in body["error"]["message"]


def test_sc_top_k_beyond_the_vocabulary_names_the_field(srv):
    status, _, body = post(srv, msg(sc_top_k=10**6))  # beyond the demo's vocabulary
    assert status == 400 and body["error"]["param"] == "sc_top_k", body


def test_stop_counts_only_the_tokens_up_to_the_stop():
    b = Answer(_Tok(), eos_ids=(1,), stop=(" STOP",))
    _add(b, [7, 8, 10, 9])  # Hello, world, STOP, !
    assert b.content == "Hello world" and b.completion_tokens == 3


def test_temperature_zero_without_seed_is_reproducible(srv):
    body = msg("Name a fruit.", temperature=0, max_tokens=24, max_denoising_steps=2)
    first = post(srv, body)[2]["choices"][0]["message"]["content"]
    assert post(srv, body)[2]["choices"][0]["message"]["content"] == first


# --------------------------------------------------------------------------- hostile input (issue 24)


def test_lone_surrogate_is_a_400_naming_the_field(srv):
    data = '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}'
    status, _, body = srv.raw("POST", C, data)
    assert status == 400 and body["error"]["param"] == "messages[0].content", body
    status, _, body = srv.raw("POST", C, '{"messages": [{"role": "user", "content": "hi"}], "stop": "\\udfff"}')
    assert status == 400 and body["error"]["param"] == "stop", body
    assert not any("Traceback" in ln for ln in srv.lines)


@pytest.mark.parametrize("flags, named", [(["--max-body-mb", "inf"], "--max-body-mb"),
                                          (["--max-body-mb", "nan"], "--max-body-mb"),
                                          (["--max-request-seconds", "-1"], "--max-request-seconds"),
                                          (["--parallel", "0"], "--parallel"),
                                          (["--header-timeout", "0"], "--header-timeout")])
def test_bad_flags_fail_before_loading(tmp_path, flags, named):
    env = {**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0", *flags],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "loading" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- signals


# SIGHUP (the terminal closed) as SIGTERM: it printed a traceback from inside the event loop and cut
# streams off without their final event
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_while_streaming_is_a_clean_stop(tmp_path, sig):
    s = Server(str(tmp_path))
    try:
        s.wait_ready(300)
        sock = send_raw_request(s, {**msg("a long answer", **HOLD), "stream": True,
                                    "diffusion": {"stream_steps": True}})
        buf = b""
        while b'"type":"step"' not in buf:
            data = sock.recv(65536)
            assert data, buf
            buf += data
        s.proc.send_signal(sig)
        sock.settimeout(60)
        while True:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
        sock.close()
        assert s.proc.wait(60) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    # the client got a final event (an error naming the shutdown), then [DONE], then a clean close
    assert b"server_shutdown" in buf and buf.rstrip().endswith(b"0"), buf[-300:]
    assert buf.index(b"server_shutdown") < buf.rindex(b"data: [DONE]"), buf[-300:]
    wait_for(lambda: "mlx-dgemma serve: stopped" in s.lines, 5)
    text = "\n".join(s.lines)
    assert "Traceback" not in text and "CancelledError" not in text, text[-2000:]
    assert s.lines[-1] == "mlx-dgemma serve: stopped", s.lines[-5:]


# --------------------------------------------------------------------------- what clients expect (item 4)


def test_any_model_name_is_served_by_the_one_model(srv):
    for path, body in ((C, msg(model="gpt-4o")), ("/v1/completions", {"prompt": "Hi", "model": "x", "max_tokens": 4,
                                                                      "max_denoising_steps": 1})):
        status, _, answer = post(srv, body, path)
        assert status == 200 and answer["model"] == "mlx-dgemma-demo", answer
    # and looked up: clients look a name up before they use it
    status, _, card = srv.raw("GET", "/v1/models/gpt-4o")
    assert status == 200 and card["id"] == "mlx-dgemma-demo" and card["max_model_len"] == 4096


def test_response_format_is_refused_not_ignored(srv):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "json"):
        status, _, body = post(srv, msg(response_format=fmt))
        assert status == 400 and body["error"]["param"] == "response_format", body
    assert post(srv, msg(response_format={"type": "text"}))[0] == 200


def test_metrics_in_prometheus_text(srv):
    def metrics() -> dict[str, str]:
        status, headers, text = srv.raw("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        return dict(ln.split() for ln in text.decode().splitlines() if not ln.startswith("#"))

    before = metrics()  # whatever the module's earlier tests served: this test counts its own answer
    status, _, body = post(srv, msg())
    assert status == 200, body
    served = "mlx_dgemma_requests_served_total"
    tokens = "mlx_dgemma_completion_tokens_total"
    deadline = time.monotonic() + 10  # the worker counts a request just after its answer is sent
    while int((after := metrics())[served]) == int(before[served]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(after[served]) == int(before[served]) + 1
    assert int(after[tokens]) == int(before[tokens]) + body["usage"]["completion_tokens"]
    assert "mlx_dgemma_requests_waiting" in after


def test_non_loopback_host_without_a_key_warns():
    from mlx_dgemma.server.cli import host_warning

    assert "--api-key" in host_warning("0.0.0.0", None)
    assert host_warning("0.0.0.0", "k") is None and host_warning("127.0.0.1", None) is None
    assert host_warning("::1", None) is None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("demo-key")), "--api-key", "s3cret", "--cors", "http://app.example",
               "--max-request-seconds", "4")
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def test_api_key_and_cors(keyed):
    status, headers, body = keyed.raw("GET", "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    assert keyed.raw("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert keyed.raw("GET", "/health")[0] == 200  # liveness probes need no key
    status, _, body = keyed.raw("POST", C, json.dumps(msg()), headers={"Authorization": "Bearer s3cret"})
    assert status == 200, body
    # a browser's preflight from the allowed origin, and a request from another origin
    status, headers, _ = keyed.raw("OPTIONS", C, headers={"Origin": "http://app.example",
                                                         "Access-Control-Request-Method": "POST"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
    _, headers, _ = keyed.raw("GET", "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in headers}


def test_max_request_seconds_answers_what_is_done(keyed):
    t0 = time.perf_counter()
    # more steps than the demo takes in 4 s on any machine: the first block is still in progress
    status, _, body = keyed.raw("POST", C, json.dumps(msg("a long one", **{**HOLD, "max_denoising_steps": 400})),
                                headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert time.perf_counter() - t0 < 30  # not the 400 steps the request asked for
    # the block in progress comes back as its latest draft (it was 0 tokens: the block had not finished)
    assert body["usage"]["completion_tokens"] > 0, body
    assert wait_for(lambda: any("timeout=True" in ln for ln in keyed.request_lines()), 10)
