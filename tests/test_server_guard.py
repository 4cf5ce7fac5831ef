"""Who may talk to `mlx-dgemma serve`, decided before any work (issue 29, items 2, 3 and 8):
a web page cannot make the server work (Origin, Content-Type, Host against DNS rebinding);
silent or trickling connections cannot lock anyone out (room made for newcomers, total
deadlines for a request's head and body); malformed HTTP and refusals are JSON, the API key
is checked before routing and its scheme in any case.

The rules are unit-tested on ASGI scopes and the connection guard on uvicorn's protocol with a
fake transport; the live tests run one `serve --demo` with small limits over real sockets."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import threading
import time
from typing import Any

import pytest

from mlx_dgemma.server.guard import SURGE, check_host_names, guarded_protocol, refusal
from tests.test_server import wait_for
from tests.test_server_limits import HOLD, Server, msg

C = "/v1/chat/completions"
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 32


def _scope(method: str = "GET", path: str = "/v1/models", headers: dict[str, str] | None = None) -> dict:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]}


def _refusal(headers: dict[str, str], method: str = "GET", path: str = "/v1/models", *,
             hosts: tuple[str, ...] | None = (), origins: tuple[str, ...] = (), key: str | None = None) -> Any:
    return refusal(_scope(method, path, headers), allowed_hosts=hosts, origins=origins, api_key=key)


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LocalHost.", "app.localhost:3000", "127.0.0.1",
                                  "127.8.9.10:80", "[::1]", "[::1]:8080", "[::ffff:127.0.0.1]:1", "my.box",
                                  "MY.BOX:9", "localhost:"])
def test_loopback_names_and_allowed_names_pass(host):
    assert _refusal({"host": host}, hosts=("my.box",)) is None


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "0.0.0.0", "192.168.1.2:8080", "[::1", "::1", "", "localhost:80x", "my.box.evil",
                                  "[::2]:80"])
def test_other_host_names_are_refused_where_hosts_are_checked(host):
    e = _refusal({"host": host}, hosts=("my.box",))
    assert e.status == 403 and e.code == "host_not_allowed" and e.message.startswith("Host: "), e
    assert "--allowed-hosts" in e.message and "\n" not in e.message
    assert _refusal({"host": host}, hosts=None) is None  # a bind other than loopback, no --allowed-hosts
    assert _refusal({"host": host}, hosts=("*",)) is None


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:3000", "http://app.example/"])
def test_an_origin_not_given_to_cors_is_refused_whatever_the_method(origin):
    for method in ("GET", "POST", "OPTIONS"):
        e = _refusal({"origin": origin}, method, hosts=None, origins=("http://app.example",))
        assert e.status == 403 and e.code == "origin_not_allowed" and "--cors" in e.message, e
    assert _refusal({"origin": origin}, hosts=None, origins=("*",)) is None
    assert _refusal({"origin": "http://app.example"}, hosts=None, origins=("http://app.example",)) is None


@pytest.mark.parametrize("value, ok", [(f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER {KEY}", True),
                                       (f"Bearer  {KEY} ", True), ("Bearer wrong", False), (f"Basic {KEY}", False),
                                       (KEY, False), (f"Bearer{KEY}", False), ("Bearer é", False), ("", False)])
def test_the_api_key_scheme_is_case_insensitive(value, ok):
    e = _refusal({"authorization": value} if value else {}, hosts=None, key=KEY)
    assert (e is None) == ok, e
    if not ok:
        assert e.status == 401 and e.code == "invalid_api_key" and e.headers == {"WWW-Authenticate": "Bearer"}
    assert _refusal({}, "GET", "/health", hosts=None, key=KEY) is None  # liveness probes need no key


@pytest.mark.parametrize("ctype, ok", [("application/json", True), ("Application/JSON; charset=utf-8", True),
                                       ("text/plain", False), ("text/plain; charset=utf-8", False),
                                       ("application/x-www-form-urlencoded", False),
                                       ("multipart/form-data; boundary=x", False), (None, False),
                                       ("application/json-seq", False)])
def test_a_body_must_be_declared_json(ctype, ok):
    headers = {"content-length": "2", **({"content-type": ctype} if ctype else {})}
    e = _refusal(headers, "POST", C, hosts=None)
    assert (e is None) == ok, e
    if not ok:
        assert e.status == 415 and e.code == "unsupported_media_type" and e.message.startswith("Content-Type: ")
        assert "-H 'Content-Type: application/json'" in e.message
    chunked = {"transfer-encoding": "chunked", **({"content-type": ctype} if ctype else {})}
    assert (_refusal(chunked, "POST", C, hosts=None) is None) == ok
    assert _refusal({"content-length": "0"}, "POST", C, hosts=None) is None  # no body: nothing to misread


def test_a_web_page_is_refused_before_the_key_and_the_key_before_the_body():
    page = {"host": "evil.example", "origin": "http://evil.example", "content-type": "text/plain",
            "content-length": "9"}
    assert _refusal(page, "POST", C, key=KEY).code == "host_not_allowed"
    assert _refusal({**page, "host": "localhost"}, "POST", C, key=KEY).code == "origin_not_allowed"
    del page["origin"]
    assert _refusal({**page, "host": "localhost"}, "POST", C, key=KEY).code == "invalid_api_key"
    assert _refusal({**page, "host": "localhost", **AUTH}, "POST", C, key=KEY).code == "unsupported_media_type"


@pytest.mark.parametrize("names, bad", [(["http://my.box"], "http://my.box"), (["my.box:8080"], "my.box:8080"),
                                        (["my.box/x"], "my.box/x"), ([""], ""), (["a..b"], "a..b")])
def test_allowed_hosts_that_could_never_match_are_refused(names, bad):
    with pytest.raises(ValueError) as e:
        check_host_names(names)
    assert str(e.value) == bad
    assert check_host_names(["My.Box.", "[::0:1]", "10.0.0.2", "*"]) == ("my.box", "::1", "10.0.0.2", "*")
    assert _refusal({"host": "[fd00::0:5]:80"}, hosts=check_host_names(["fd00::5"])) is None  # one written form


# --------------------------------------------------------------------------- the rules in the app


def _client(served, **settings: Any) -> tuple[Any, Any]:
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import create_app
    from mlx_dgemma.server.app import Settings

    engine, _ = served
    return engine, TestClient(create_app(engine, Settings(**settings)))  # no lifespan: the engine runs already


def test_a_web_page_cannot_make_the_server_work(served):
    # browsers send these without a preflight: were read as JSON and answered (generation ran)
    engine, client = _client(served, cors_origins=("http://app.example",))
    before = engine.served
    body = json.dumps(msg())
    for headers in ({"content-type": "text/plain", "origin": "http://evil.example"},
                    {"content-type": "application/x-www-form-urlencoded", "origin": "null"},
                    {"content-type": "multipart/form-data; boundary=x", "origin": "http://evil.example"}):
        r = client.post(C, content=body, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert "access-control-allow-origin" not in r.headers
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        r = client.post(C, content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    assert engine.served == before  # refused before any work
    r = client.post(C, content=body, headers={"content-type": "application/json", "origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example", r.text
    assert engine.served == before + 1


def test_the_api_key_is_checked_before_routing(served):
    # GET /metrics/ without the key was a 307 to /metrics; 'bearer KEY' was a 401
    _, client = _client(served, api_key=KEY, cors_origins=("http://app.example",))
    r = client.get("/metrics/", follow_redirects=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    for path in ("/v1/nothing", "/metrics"):
        assert client.get(path).status_code == 401
    r = client.post(C, content=b"{", headers={"content-type": "application/json"})  # its body is not even read
    assert r.status_code == 401
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert client.get("/v1/models", headers={"authorization": f"{scheme} {KEY}"}).status_code == 200, scheme
    assert client.get("/health").status_code == 200
    # an allowed page without the key can read why (CORS headers on the 401)
    r = client.get("/v1/models", headers={"origin": "http://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://app.example"


def test_host_names_are_checked_when_the_settings_say(served):
    _, client = _client(served, allowed_hosts=("my.box",))
    r = client.get("/health", headers={"host": "evil.example:8080"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "my.box"):
        assert client.get("/health", headers={"host": host}).status_code == 200, host


# --------------------------------------------------------------------------- the connection guard, unit


class FakeTransport:
    """What uvicorn's h11 protocol uses of an asyncio transport; records what is written."""

    def __init__(self) -> None:
        self.out, self.closed = bytearray(), False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _guarded(max_connections: int) -> tuple[Any, asyncio.Event]:
    """(a function opening a guarded connection on a fake transport, the event that lets the
    app answer: until then every whole request is being answered)."""
    import uvicorn
    from uvicorn.server import ServerState

    release = asyncio.Event()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    config = uvicorn.Config(app, log_config=None)
    config.load()
    cls = guarded_protocol(max_connections, header_timeout=60, body_timeout=60)
    state = ServerState()

    def connect(data: bytes = b"") -> tuple[Any, FakeTransport]:
        p, t = cls(config=config, server_state=state, app_state={}), FakeTransport()
        p.connection_made(t)
        if data:
            p.data_received(data)
        return p, t

    return connect, release


async def _turns(n: int = 4) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


WHOLE = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{"


def test_room_is_made_by_closing_the_oldest_connection_without_a_whole_request():
    # at --max-connections, newcomers were refused (503) while silent connections held every place
    async def run() -> None:
        connect, release = await _guarded(2)
        (_, answering), (_, silent), (_, partial) = connect(WHOLE), connect(), connect(PARTIAL)
        await _turns()
        assert silent.closed and silent.out == b""  # the oldest without a request: closed without a word
        assert not answering.closed and not partial.closed
        _, newest = connect()
        await _turns()
        assert partial.closed and partial.out.startswith(b"HTTP/1.1 503") and b"too_many_connections" in partial.out
        assert not answering.closed and not newest.closed and newest.out == b""
        release.set()
        await _turns()
        assert answering.out.startswith(b"HTTP/1.1 200")

    asyncio.run(run())


def test_a_newcomer_is_refused_only_when_every_connection_is_being_answered():
    async def run() -> None:
        connect, release = await _guarded(1)
        held = [connect(WHOLE)[1] for _ in range(1 + SURGE)]
        await _turns()
        assert not any(t.closed for t in held)  # requests being answered are never closed for room
        _, late = connect()
        assert late.closed and late.out.startswith(b"HTTP/1.1 503") and b"too_many_connections" in late.out
        assert json.loads(bytes(late.out).split(b"\r\n\r\n", 1)[1])["error"]["type"] == "server_error"
        release.set()
        await _turns()
        assert all(t.out.startswith(b"HTTP/1.1 200") for t in held)

    asyncio.run(run())


# --------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("demo")), "--max-connections", str(MAX_CONNECTIONS), "--queue-size", "2",
               "--header-timeout", "1", "--body-timeout", "2", "--allowed-hosts", "my.box", "--api-key", KEY)
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def _exchange(srv: Server, data: bytes, timeout: float = 20) -> bytes:
    """Send ``data`` on a fresh connection; everything received until the server closes it."""
    with socket.create_connection((srv.host, srv.port)) as s:
        s.settimeout(timeout)
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _json_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_host_that_is_not_this_machine_is_refused_on_a_loopback_bind(live):
    status, _, body = live.raw("GET", "/health", headers={"Host": f"evil.example:{live.port}"})
    assert status == 403 and body["error"]["code"] == "host_not_allowed", body
    for host in (f"localhost:{live.port}", f"127.0.0.1:{live.port}", "my.box"):  # the last: --allowed-hosts
        assert live.raw("GET", "/health", headers={"Host": host})[0] == 200, host


MALFORMED = {
    "request line": b"HELLO\r\n\r\n",
    "header line": b"GET /health HTTP/1.1\r\nHost: localhost\r\nno colon here\r\n\r\n",
    "content length": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n",
    "two lengths": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\n"
                   b"Content-Length: 4\r\n\r\nabcd",
    "chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "no host": b"GET /health HTTP/1.1\r\n\r\n",
    "control byte": b"GET /he\x00alth HTTP/1.1\r\nHost: localhost\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_request_is_a_json_error(live, name):
    # were uvicorn's plain-text "Invalid HTTP request received."
    status, err = _json_error(_exchange(live, MALFORMED[name]))
    assert status == 400 and err["code"] == "invalid_http_request", err
    assert err["message"].startswith("invalid HTTP request (") and "\n" not in err["message"]


def test_an_unsupported_transfer_coding_is_a_json_501(live):
    data = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip\r\n\r\n"
    status, err = _json_error(_exchange(live, data))
    assert status == 501 and "chunked" in err["message"], err
    assert live.raw("GET", "/health")[0] == 200
    assert not any("Invalid HTTP request received" in ln or "Traceback" in ln for ln in live.lines), live.lines[-5:]


class Flood:
    """``n`` connections held open, each reopened at once when the server closes it: silent ones,
    or ones that send a request head and then a body byte every ``every`` seconds."""

    def __init__(self, srv: Server, n: int, trickle: bool, every: float = 0.5):
        self.addr, self.n, self.trickle, self.every = (srv.host, srv.port), n, trickle, every
        self.opened, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _open(self, sel: selectors.BaseSelector) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(self.addr)
        sel.register(s, selectors.EVENT_READ)
        self.opened += 1
        if self.trickle:
            try:
                s.send(f"POST {C} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       "Content-Length: 100000\r\n\r\n".encode())
            except OSError:
                pass

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for _ in range(self.n):
            self._open(sel)
        last = time.monotonic()
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                try:
                    if key.fileobj.recv(65536):
                        continue  # an answer (401, 408); the close follows
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sel.unregister(key.fileobj)
                key.fileobj.close()
                self._open(sel)
            if self.trickle and time.monotonic() - last >= self.every:
                last = time.monotonic()
                for key in list(sel.get_map().values()):
                    try:
                        key.fileobj.send(b" ")
                    except OSError:
                        pass
        for key in list(sel.get_map().values()):
            key.fileobj.close()


def test_silent_and_trickling_connections_lock_nobody_out(live):
    # at --max-connections' worth of silent connections, reopened as the server closed them,
    # every /health was refused; trickled bodies were never closed. Here the attacker holds more
    # connections than the limit, with no key; a keyed request runs through it all.
    assert wait_for(lambda: not live.raw("GET", "/health")[2]["busy"], 60)
    result: dict[str, Any] = {}

    def held() -> None:
        body = msg("a held answer", **{**HOLD, "max_denoising_steps": 4})  # 4 steps, whatever the canvas
        result["answer"] = live.raw("POST", C, json.dumps(body), headers=AUTH)
        result["done"] = time.monotonic()

    worker = threading.Thread(target=held)
    worker.start()
    assert wait_for(lambda: live.raw("GET", "/health")[2]["busy"], 60)
    n = MAX_CONNECTIONS + 8
    with Flood(live, n, trickle=False) as silent, Flood(live, n, trickle=True, every=0.2) as trickling:
        flooded = time.monotonic()
        assert wait_for(lambda: silent.opened > 2 * n and trickling.opened > 2 * n, 30)  # places change hands
        answers = [live.raw("GET", "/health")[0] for _ in range(12)]
    worker.join(120)
    assert answers == [200] * 12, answers
    status, _, body = result["answer"]
    assert status == 200 and body["choices"][0]["finish_reason"], body
    assert result["done"] > flooded  # it was running all through the flood


def test_a_trickled_body_is_cut_at_its_total_deadline(live):
    # the body timeout counted the gap between bytes: a byte every 0.2 s kept a request open for ever
    def trickle(headers: str) -> tuple[bytes, bool]:
        """(what the server answered, whether it closed the connection within 30 s of bytes)."""
        with socket.create_connection((live.host, live.port)) as s:
            s.sendall(f"POST {C} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{headers}"
                      "Content-Length: 100000\r\n\r\n".encode())
            s.settimeout(0.2)
            out, end = b"", time.monotonic() + 30
            while time.monotonic() < end:
                try:
                    s.sendall(b" ")
                    chunk = s.recv(65536)
                except socket.timeout:
                    continue
                except OSError:  # closed while we were sending
                    return out, True
                if not chunk:
                    return out, True
                out += chunk
            return out, False

    out, closed = trickle(f"Authorization: Bearer {KEY}\r\n")
    status, err = _json_error(out)
    assert status == 408 and err["code"] == "request_timeout" and "--body-timeout" in err["message"], err
    assert closed
    out, closed = trickle("")  # refused at once (no key); the connection is closed all the same, bytes or not
    assert _json_error(out)[1]["code"] == "invalid_api_key" and closed
