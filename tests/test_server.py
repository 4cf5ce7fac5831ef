"""`mlx-dgemma serve` against real clients on 127.0.0.1: the official `openai` package, raw
HTTP for hostile requests, raw sockets for disconnects. One live server (a subprocess on the
demo model, free port) serves the whole module; answers are kept to one 64-token block and
one denoising step (where steps are not the point) so that the file runs in seconds of generation."""

import concurrent.futures as cf
import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")

from mlx_dgemma.chat_template import THOUGHT_CLOSE, THOUGHT_OPEN  # noqa: E402
from mlx_dgemma.server import Answer, Deltas  # noqa: E402

QUEUE = 2  # waiting requests before 503
# sent as extra body fields: one block, one step; a one-step block never meets the stopping rule,
# so the commit guard (tested in test_guards.py) is off for these tests of the server's mechanics
FAST = {"max_denoising_steps": 1, "commit_entropy": 0}
MODEL = "mlx-dgemma-demo"


class LiveServer:
    """`python -m mlx_dgemma serve --demo --port 0` with its log lines collected."""

    def __init__(self, tmp: str):
        env = {**os.environ, "MLX_DGEMMA_CACHE": tmp}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0", "--queue-size", str(QUEUE),
             "--max-body-mb", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        """The URL line, then /health 200: loaded and warmed up (503 "loading" until then)."""
        end = time.monotonic() + timeout
        self._ready.wait(timeout)
        if self.url is None:
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
        self.host, port = self.url.removeprefix("http://").split(":")
        self.port = int(port)
        while self.raw("GET", "/health")[0] != 200:
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError("server did not get ready:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def request_lines(self) -> list[str]:
        return [ln for ln in self.lines if re.search(r" (GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) /", ln)]

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", **kw)

    def raw(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
            chunked: bool = False) -> tuple[int, dict, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)  # a long prompt on a loaded 2-core machine: minutes
        try:
            if isinstance(body, str):
                body = body.encode()
            if chunked:
                conn.request(method, path, body=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                             headers={"Content-Type": "application/json", **(headers or {})}, encode_chunked=True)
            else:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            data = r.read()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = data
            return r.status, dict(r.getheaders()), parsed
        finally:
            conn.close()


@contextlib.contextmanager
def live_server(tmp_path_factory) -> Iterator[LiveServer]:
    srv = LiveServer(str(tmp_path_factory.mktemp("demo-cache")))
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory) as srv:
        yield srv


def chat(srv: LiveServer, content: str = "Why is the sky blue?", client: Any = None, **kw: Any) -> Any:
    extra = {**FAST, **kw.pop("extra_body", {})}
    return (client or srv.client(max_retries=0)).chat.completions.create(
        model=MODEL, messages=kw.pop("messages", [{"role": "user", "content": content}]),
        max_tokens=kw.pop("max_tokens", 64), extra_body=extra, **kw)


def quiet(srv: LiveServer) -> None:
    """Wait until the worker is idle and every earlier request's log line is written."""
    assert wait_for(lambda: (lambda h: not h["busy"] and h["queued"] == 0)(srv.raw("GET", "/health")[2]))
    n = -1
    while n != len(srv.request_lines()):
        n = len(srv.request_lines())
        time.sleep(0.3)


def wait_for(pred, timeout: float = 30.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# --------------------------------------------------------------------------- the openai client


def test_models_and_health(server):
    ids = [m.id for m in server.client().models.list()]
    assert ids == [MODEL]
    status, _, body = server.raw("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert body["memory_bytes"] > 1 << 20  # the process holds a model: memory.memory_bytes(), read on the worker


def test_chat_non_stream(server):
    r = chat(server, seed=11, max_tokens=20)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 20  # max_tokens is exact even though a block is 64 tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    assert choice.finish_reason == "stop" or u.completion_tokens == 20
    # same seed, same request: same answer (the server adds no randomness of its own)
    assert chat(server, seed=11, max_tokens=20).choices[0].message.content == choice.message.content


def test_chat_stream_matches_non_stream(server):
    kw = dict(seed=5, max_tokens=64)
    whole = chat(server, **kw)
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert not any((c.model_extra or {}).get("diffusion") for c in chunks)  # not asked for: never sent


def test_stream_steps_extension(server):
    chunks = list(chat(server, seed=2, stream=True, max_tokens=64,
                       extra_body={"diffusion": {"stream_steps": True}, "max_denoising_steps": 3}))
    events = [(c.model_extra or {}).get("diffusion") for c in chunks]
    steps = [e for e in events if e and e["type"] == "step"]
    blocks = [e for e in events if e and e["type"] == "block"]
    assert len(blocks) == 1 and 1 <= len(steps) == blocks[0]["steps"] <= 3
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    for s in steps:
        assert s["block"] == 1 and s["max_steps"] == 3  # blocks count from 1, as steps do
        assert len(s["tokens"]) == len(s["accepted"]) == 64  # the demo's canvas
        assert set(s["accepted"]) <= {0, 1} and isinstance(s["draft"], str)
        assert s["mean_entropy"] >= 0 and s["temperature"] > 0
    # step events come before the block's content delta, the content after the block event
    first_content = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert first_content > max(i for i, e in enumerate(events) if e)


def test_completions(server):
    c = server.client(max_retries=0)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, seed=1, extra_body=FAST)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 10 and r.choices[0].finish_reason in ("stop", "length")
    streamed = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, seed=1,
                                         stream=True, extra_body=FAST))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


def test_temperature_maps_to_schedule(server):
    """temperature scales the whole schedule: the streamed steps report it."""
    def first_temp(**kw):
        chunks = chat(server, seed=1, stream=True, extra_body={"diffusion": {"stream_steps": True}, **FAST}, **kw)
        return next(c.model_extra["diffusion"]["temperature"] for c in chunks
                    if (c.model_extra or {}).get("diffusion", {}).get("type") == "step")

    base = first_temp()
    assert first_temp(temperature=0.5) == pytest.approx(base * 0.5, rel=1e-4)
    assert 0 < first_temp(temperature=0) == pytest.approx(base * 0.01, rel=1e-4)


# --------------------------------------------------------------------------- conversations


def test_prefix_reuse_prefills_only_the_new_turn(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    t1 = chat(server, messages=msgs, seed=3)
    assert t1.usage.prompt_tokens_details.cached_tokens == 0
    answer = {"role": "assistant", "content": t1.choices[0].message.content}
    # an edited earlier answer is not an extension of that conversation: no reuse
    edited = msgs + [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "And another one?"}]
    assert chat(server, messages=edited, seed=3).usage.prompt_tokens_details.cached_tokens == 0
    assert chat(server, messages=msgs, seed=3).choices[0].message.content == answer["content"]  # turn 1 again
    msgs2 = msgs + [answer, {"role": "user", "content": "And another one?"}]
    reused_before = server.raw("GET", "/health")[2]["reused_prefixes"]
    t2 = chat(server, messages=msgs2, seed=3)
    cached = t2.usage.prompt_tokens_details.cached_tokens
    assert server.raw("GET", "/health")[2]["reused_prefixes"] == reused_before + 1
    # the cache held turn 1 as a fresh render of msgs2 holds it (the user's turn and the answer; not
    # turn 1's generation prompt nor its padding, issue 23 F4); only the new turn was prefilled
    assert t1.usage.prompt_tokens // 2 < cached < t1.usage.prompt_tokens + t1.usage.completion_tokens
    prefilled = t2.usage.prompt_tokens - cached
    # the same request again extends nothing (the session now holds turn 2): all prefilled, and
    # the same prompt and answer as with the cache hit
    fresh = chat(server, messages=msgs2, seed=3)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < prefilled < fresh.usage.prompt_tokens - t1.usage.prompt_tokens
    assert fresh.usage.prompt_tokens == t2.usage.prompt_tokens
    assert fresh.choices[0].message.content == t2.choices[0].message.content


def test_earlier_thoughts_are_not_rendered(server):
    def prompt_tokens(assistant: dict) -> int:
        msgs = [{"role": "user", "content": "Hi"}, assistant, {"role": "user", "content": "Go on"}]
        return chat(server, messages=msgs, seed=0, max_tokens=1,
                    extra_body={"max_denoising_steps": 1}).usage.prompt_tokens

    plain = prompt_tokens({"role": "assistant", "content": "Sure."})
    # enable_thinking reaches the template (which then leaves the thought channel open)
    msgs = [{"role": "user", "content": "Hi"}]
    off = chat(server, messages=msgs, seed=0, max_tokens=1).usage.prompt_tokens
    on = chat(server, messages=msgs, seed=0, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage.prompt_tokens != off
    with_thought = prompt_tokens({"role": "assistant",
                                  "content": f"{THOUGHT_OPEN}thought\nA long secret plan, many words.{THOUGHT_CLOSE}Sure."})
    with_field = prompt_tokens({"role": "assistant", "content": "Sure.", "reasoning_content": "a long secret plan"})
    assert plain == with_thought == with_field


class _Tok:
    """A word-level tokenizer: enough to exercise the answer bookkeeping exactly."""

    vocab = ["<pad>", "<eos>", THOUGHT_OPEN, THOUGHT_CLOSE, "thought\n", "plan ", "more ", "Hello", " world", "!",
             " STOP", "\ufffd"]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_bos=False):
        return [self.vocab.index(text)] if text in self.vocab else [0, 0]


def _add(a: Answer, ids: list[int]) -> None:
    from mlx_dgemma.chat_template import parse_answer

    parsed = parse_answer(_Tok().decode(a.tokens + ids))
    a.add(tuple(ids), parsed.answer, parsed.thinking)


def test_answer_keeps_thoughts_out_of_content():
    a = Answer(_Tok(), eos_ids=(1,))
    _add(a, [2, 4, 5, 6, 3, 7, 8, 1, 0, 0])
    assert a.content == "Hello world" and a.reasoning == "plan more"
    assert THOUGHT_OPEN not in a.content and "plan" not in a.content
    assert a.reasoning_tokens == 5 and a.completion_tokens == 8 and a.finish_reason == "stop"


def test_answer_max_tokens_stop_and_holdback():
    a = Answer(_Tok(), eos_ids=(1,), max_tokens=3)
    _add(a, [7, 8, 9, 9, 1])
    assert a.content == "Hello world!" and a.completion_tokens == 3 and a.cut and a.finish_reason == "length"
    b = Answer(_Tok(), eos_ids=(1,), stop=(" STOP",))
    _add(b, [7, 8, 10, 9])
    assert b.content == "Hello world" and b.stop_hit and b.finish_reason == "stop"
    c = Answer(_Tok(), eos_ids=(1,), stop=("!!",))
    _add(c, [7, 8, 9])  # "...!" may become "!!" with the next block: held back while streaming
    assert c.streamable()[0] == "Hello world" and c.content == "Hello world!"
    d = Answer(_Tok(), eos_ids=(1,))
    _add(d, [7, 11])  # a half character at the block's end is held back too
    assert d.streamable()[0] == "Hello"
    deltas = Deltas()
    assert [deltas("Hel"), deltas("Hello"), deltas("Hello"), deltas("HeLlo!")] == ["Hel", "lo", "", "!"]


# --------------------------------------------------------------------------- load, cancel, abuse


def test_parallel_clients_answered_or_refused(server):
    prompts = [(f"question number {i}", 100 + i) for i in range(8)]
    clients = [server.client(max_retries=0) for _ in prompts]
    start = threading.Barrier(len(prompts))

    def ask(p):
        content, seed = p
        client = clients[prompts.index(p)]
        start.wait()  # all at once
        try:
            r = chat(server, content=content, seed=seed, client=client, extra_body={"max_denoising_steps": 1})
            return ("ok", r.choices[0].message.content, r.usage.prompt_tokens)
        except openai.APIStatusError as e:
            return (e.status_code, e.response.headers.get("retry-after"), e.body)

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(ask, prompts))
    ok = [(p, r) for p, r in zip(prompts, results) if r[0] == "ok"]
    busy = [r for r in results if r[0] != "ok"]
    assert len(ok) + len(busy) == len(prompts)  # none lost
    assert all(r[0] == 503 and int(r[1]) >= 1 and r[2]["code"] == "server_busy" for r in busy)
    assert len(ok) >= 1 + QUEUE - 1 and busy  # the queue held some and refused the rest
    # none mixed up: each answer is the one its own prompt and seed give when asked alone
    for (content, seed), (_, text, ptoks) in ok[:2]:
        alone = chat(server, content=content, seed=seed, extra_body={"max_denoising_steps": 1})
        assert (alone.choices[0].message.content, alone.usage.prompt_tokens) == (text, ptoks)


def test_disconnect_mid_stream_cancels(server):
    body = json.dumps({"model": MODEL, "stream": True, "seed": 0, "max_tokens": 64 * 8, "max_denoising_steps": 4,
                       "diffusion": {"stream_steps": True}, "messages": [{"role": "user", "content": "long"}]})
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    buf = b""
    while b'"type":"step"' not in buf:
        data = sock.recv(65536)
        assert data, buf
        buf += data
    sock.close()  # after the first step of up to 8 blocks x 4 steps
    r = chat(server, seed=1, extra_body={"max_denoising_steps": 1})
    assert r.choices[0].finish_reason in ("stop", "length")
    rid = re.search(rb'"id":"(chatcmpl-[0-9a-f]+)"', buf).group(1).decode()
    assert wait_for(lambda: any(rid in ln for ln in server.request_lines()))
    cancelled = next(ln for ln in server.request_lines() if rid in ln)
    assert "finish=cancelled" in cancelled, cancelled
    steps = int(re.search(r"steps=(\d+)", cancelled).group(1))
    assert 1 <= steps <= 4, cancelled  # stopped within the first block, not after 32 steps


def _hostile_cases() -> list[tuple[str, str, Any, int, str | None]]:
    """(method, path, body, expected status, expected error param or None)."""
    C, P = "/v1/chat/completions", "/v1/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]

    def body(**kw):
        return json.dumps({"messages": ok_msgs, **kw})

    cases: list[tuple[str, str, Any, int, str | None]] = [
        # not JSON / not an object
        ("POST", C, "", 400, None), ("POST", C, "{", 400, None), ("POST", C, "not json", 400, None),
        ("POST", C, "[1, 2]", 400, None), ("POST", C, "null", 400, None), ("POST", C, '"text"', 400, None),
        ("POST", C, "{'messages': []}", 400, None), ("POST", C, b"\xff\xfe\x00garbage", 400, None),
        ("POST", C, "[" * 200_000 + "]" * 200_000, 400, None), ("POST", C, '{"messages": NaN}', 400, "messages"),
        # messages
        ("POST", C, "{}", 400, "messages"), ("POST", C, body(messages="hi"), 400, "messages"),
        ("POST", C, body(messages=[]), 400, "messages"), ("POST", C, body(messages=[1]), 400, "messages[0]"),
        ("POST", C, body(messages=[{"content": "hi"}]), 400, "messages[0].role"),
        ("POST", C, body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        ("POST", C, body(messages=[{"role": "tool", "content": "hi"}]), 400, "messages[0].tool_call_id"),  # answers no call
        ("POST", C, body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
        ("POST", C, body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         400, "messages[0].content"),
        ("POST", C, body(messages=[{"role": "user"}]), 400, "messages[0].content"),
        ("POST", C, body(messages=[{"role": "user", "content": "   "}]), 400, "messages[0].content"),
        ("POST", C, body(messages=[{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "", "tool_calls": [
                                       {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         400, "messages[1]"),  # a call cannot be continued: its results are wanted
        # sampling fields: wrong types and out-of-range values
        ("POST", C, body(temperature="hot"), 400, "temperature"), ("POST", C, body(temperature=True), 400, "temperature"),
        ("POST", C, body(temperature=-0.1), 400, "temperature"), ("POST", C, body(temperature=2.5), 400, "temperature"),
        ("POST", C, '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, "temperature"),
        ("POST", C, body(max_tokens=0), 400, "max_tokens"), ("POST", C, body(max_tokens=-5), 400, "max_tokens"),
        ("POST", C, body(max_tokens=1.5), 400, "max_tokens"), ("POST", C, body(max_tokens="10"), 400, "max_tokens"),
        ("POST", C, body(max_completion_tokens=0), 400, "max_completion_tokens"),
        ("POST", C, body(seed=-2), 400, "seed"), ("POST", C, body(seed=2**64), 400, "seed"),
        ("POST", C, body(seed="x"), 400, "seed"),
        ("POST", C, body(stop=5), 400, "stop"),
        ("POST", C, body(stop=["a"] * 65), 400, "stop"), ("POST", C, body(stop=[""]), 400, "stop"),
        ("POST", C, body(stop=[1]), 400, "stop"),
        ("POST", C, body(stream="yes"), 400, "stream"), ("POST", C, body(stream_options=3), 400, "stream_options"),
        ("POST", C, body(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
        ("POST", C, body(n=2), 400, "n"), ("POST", C, body(n=0), 400, "n"), ("POST", C, body(top_p=2), 400, "top_p"),
        ("POST", C, body(max_denoising_steps=0), 400, "max_denoising_steps"),
        ("POST", C, body(max_denoising_steps=100_000), 400, "max_denoising_steps"),
        ("POST", C, body(t_min=0), 400, "t_min"), ("POST", C, body(t_min=0.9, t_max=0.5), 400, None),
        ("POST", C, body(entropy_bound=-1), 400, "entropy_bound"),
        ("POST", C, body(stability_threshold=-1), 400, "stability_threshold"),
        ("POST", C, body(confidence_threshold=0), 400, "confidence_threshold"), ("POST", C, body(sc_top_k=0), 400, "sc_top_k"),
        ("POST", C, body(diffusion={"stream_steps": 1}), 400, "diffusion.stream_steps"),
        ("POST", C, body(diffusion="steps"), 400, "diffusion"),
        ("POST", C, body(enable_thinking="yes"), 400, "enable_thinking"),
        ("POST", C, body(chat_template_kwargs={"enable_thinking": "yes"}), 400, "chat_template_kwargs.enable_thinking"),
        # completions
        ("POST", P, "{}", 400, "prompt"), ("POST", P, json.dumps({"prompt": 5}), 400, "prompt"),
        ("POST", P, json.dumps({"prompt": ""}), 400, "prompt"), ("POST", P, json.dumps({"prompt": []}), 400, "prompt"),
        ("POST", P, json.dumps({"prompt": [[1, 2]]}), 400, "prompt"), ("POST", P, json.dumps({"prompt": [-1]}), 400, "prompt[0]"),
        ("POST", P, json.dumps({"prompt": [5, 10**6]}), 400, "prompt[1]"),
        # unknown model, route, method
        # (any model name is served by the one model: tests/test_server_limits.py)
        ("GET", "/v2/anything", None, 404, None),
        ("GET", "/", None, 404, None), ("POST", "/v1/embeddings", "{}", 404, None),
        ("GET", C, None, 405, None), ("POST", "/v1/models", "{}", 405, None), ("DELETE", "/health", None, 405, None),
        # beyond the context (the demo's is 4096 tokens): OpenAI's context_length_exceeded, a 400
        ("POST", C, body(messages=[{"role": "user", "content": "word " * 5000}]), 400, "messages"),
        ("POST", P, json.dumps({"prompt": "word " * 5000}), 400, "prompt"),
    ]
    return cases


@pytest.fixture
def own_server(tmp_path_factory):
    """A server no other test has used: the log-line count below sees only this test's requests
    (a shared one could still be writing a late line for an earlier test's request under load)."""
    with live_server(tmp_path_factory) as srv:
        yield srv


def test_hostile_requests(own_server):
    server = own_server
    cases = _hostile_cases()
    assert len(cases) >= 50
    quiet(server)

    def others() -> list[str]:  # quiet() polls /health: count every other request
        return [ln for ln in server.request_lines() if "GET /health" not in ln]

    def counted() -> int:
        return len(others())

    n_before = counted()
    for method, path, body, status, param in cases:
        got, headers, answer = server.raw(method, path, body)
        assert got == status, (method, path, str(body)[:120], answer)
        assert isinstance(answer, dict) and isinstance(answer["error"]["message"], str), answer
        assert answer["error"]["message"] and answer["error"]["type"]
        if param is not None:
            assert answer["error"]["param"] == param, (str(body)[:120], answer)
    # huge bodies: declared or chunked, past --max-body-mb 1
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    for chunked in (False, True):
        got, _, answer = server.raw("POST", "/v1/chat/completions", big, chunked=chunked)
        assert got == 413 and answer["error"]["code"] == "body_too_large"
    # unknown fields are ignored as OpenAI clients expect
    got, _, answer = server.raw("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 4, "frobnicate": {"x": 1},
        "logit_bias": {"5": 1}, "user": "me", "top_p": 0.9, **FAST}))
    assert got == 200 and answer["choices"][0]["message"]["role"] == "assistant"
    # still healthy, one log line per request
    assert server.raw("GET", "/health")[0] == 200
    assert chat(server, seed=0, extra_body={"max_denoising_steps": 1}).choices[0].finish_reason in ("stop", "length")
    expected = len(cases) + 2 + 1 + 1  # cases, two huge bodies, unknown fields, the last chat
    quiet(server)
    assert counted() - n_before == expected, others()[n_before:]
    assert server.proc.poll() is None


def test_cli_errors_are_one_line(tmp_path):
    env = {**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "serve", "--port", "0"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", str(port)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and f"{port}" in r.stderr and "Traceback" not in r.stderr
    notice, *error = r.stderr.strip().splitlines()  # the demo's notice comes first (serve --demo)
    assert notice.startswith("[demo]") and "not DiffusionGemma's weights" in notice and len(error) == 1
