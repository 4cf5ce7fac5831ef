"""Who may talk to the server, decided before any work.

- The request rules (:func:`refusal`), applied by ``app.Guard`` to every request before it is
  routed or its body read: on a loopback bind, a ``Host`` that names this machine (DNS
  rebinding gives a web page's requests the attacker's host name); an ``Origin`` the server was
  started with (``--cors``: browsers send one with every cross-origin request, and with no
  preflight for a "simple" POST); the API key; a body declared ``application/json`` (the types
  a browser may send without a preflight are text/plain and the two form types).
- The connection guard (:func:`guarded_protocol`): uvicorn's h11 protocol with a connection
  limit that, when reached, closes the oldest connection that carries no whole request (silent,
  idle, or still sending its head or body) before it refuses anyone; a total deadline for each
  request's head and one for its body (not a gap between bytes: a byte every few seconds must
  not hold a connection for ever); and malformed HTTP answered as JSON like every other error.

Standard library only at the top: ``mlx_dgemma.server.cli`` imports this module and must stay
light (``mlx-dgemma --help`` builds every parser); h11 and uvicorn are imported in
:func:`guarded_protocol`.
"""

from __future__ import annotations

import array
import functools
import http
import ipaddress
import itertools
import json
import logging
import math
import re
import secrets
import time
from typing import Any, Callable

from mlx_dgemma.server.errors import APIError

log = logging.getLogger("mlx_dgemma.server")

OPEN_PATHS = ("/health",)  # answered without the API key: liveness probes
BODY_METHODS = ("POST", "PUT", "PATCH")
JSON_TYPE = "application/json"
REFUSAL_LOG_SECONDS = 10.0  # refused connections and malformed requests are logged at most once per this many seconds
# The app answers a body still incomplete at --body-timeout with a 408 (app.BodyLimit); the
# connection itself is closed this much later if it has not been: the app answered early (a
# refusal) and the client is still sending, or the route does not read bodies.
BODY_GRACE_SECONDS = 1.0
DETAIL_CHARS = 120  # a client's bytes quoted in an error, at most
# Connections accepted past --max-connections until the loop has read what they sent: room is
# made after that read (see guarded_protocol), when a whole request can be told from a silent
# or trickling connection; beyond this surge, room is made at once or the newcomer refused.
SURGE = 64


# --------------------------------------------------------------------------- names


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, without port or brackets) can only mean this machine:
    ``localhost`` and names under ``.localhost`` (RFC 6761: resolvers and browsers answer them
    with loopback themselves), 127.0.0.0/8, ``::1`` (also as ``::ffff:127.x.x.x``)."""
    name = host.lower().removesuffix(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``),
    lowercased and without a final dot; None when it is not of that form."""
    if value.startswith("["):
        end = value.find("]")
        name, rest = (value[1:end], value[end + 1:]) if end > 0 else ("", "")
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    port = rest[1:]
    if rest and not (rest[0] == ":" and (not port or port.isascii() and port.isdigit())):
        return None
    return _canonical(name) or None


def _canonical(name: str) -> str:
    """A host name lowercased without its final dot; an address in its one written form
    (``::0:1`` is ``::1``)."""
    name = name.lower().removesuffix(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _is_address(name: str) -> bool:
    """``name`` is an IP address as written in a URL's host (no brackets)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_host_names(names: list[str]) -> tuple[str, ...]:
    """``--allowed-hosts`` as given: each a bare host name or address (no scheme, port or path),
    or ``*``; returned lowercased. ValueError names the first that is not."""
    out = []
    for name in names:
        bare = name.strip().lower().removesuffix(".")
        if bare == "*":
            out.append(bare)
            continue
        plain = bare.removeprefix("[").removesuffix("]")
        if _is_address(plain):
            out.append(_canonical(plain))
        elif all(part and len(part) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in part)
                 for part in bare.split(".")):
            out.append(bare)
        else:
            raise ValueError(name)
    return tuple(out)


# --------------------------------------------------------------------------- the request rules


@functools.lru_cache(maxsize=256)  # a server sees few Host values, and parsing an address is not free
def _host_allowed(value: str, allowed_hosts: tuple[str, ...]) -> bool:
    name = host_name(value)
    return name is not None and (is_loopback(name) or name in allowed_hosts)


def _short(value: str) -> str:
    r = repr(value)
    return r if len(r) <= DETAIL_CHARS else r[: DETAIL_CHARS - 3] + "..."


def _media_type(value: str) -> str:
    return value.partition(";")[0].strip().lower()


def refusal(scope: dict[str, Any], *, allowed_hosts: tuple[str, ...] | None, origins: tuple[str, ...],
            api_key: str | None) -> APIError | None:
    """Why the request in ``scope`` (an ASGI HTTP scope) is refused before any work, or None.

    In this order: the ``Host`` (only when ``allowed_hosts`` is not None: then a loopback name
    or one of them; ``*`` among them: any); the ``Origin`` (a request without one is not a
    browser's; with one, it must be in ``origins``, or ``*`` be); the API key (``Authorization:
    Bearer KEY``, the scheme in any case, RFC 7235; not on :data:`OPEN_PATHS`); a body's
    ``Content-Type`` (``application/json``, with any parameters). Host and Origin come first: a
    web page's request is refused whether it guessed the key or not."""
    headers: dict[bytes, list[str]] = {}
    for k, v in scope.get("headers") or ():
        headers.setdefault(k, []).append(v.decode("latin-1"))

    if allowed_hosts is not None and "*" not in allowed_hosts:
        for value in headers.get(b"host", ()):  # none: an HTTP/1.0 client's request, never a browser's
            if not _host_allowed(value.strip(), allowed_hosts):
                names = ", ".join(("localhost", "127.0.0.1", "[::1]", *allowed_hosts))
                return APIError(403, f"Host: {_short(value)} is not a name of this server ({names}); connect by "
                                "one of those, or start the server with --allowed-hosts NAME (other names are "
                                "refused: DNS rebinding lets a web page reach a local server by its own name)",
                                code="host_not_allowed")

    for origin in headers.get(b"origin", ()):
        if "*" not in origins and origin not in origins:
            allowed = ", ".join(origins) if origins else "none"
            return APIError(403, f"Origin: {_short(origin)} may not call this server; browser pages may call it "
                            f"only from the origins it was started with (--cors ORIGIN; now: {allowed})",
                            code="origin_not_allowed")

    if api_key is not None and scope.get("path") not in OPEN_PATHS:
        scheme, _, token = headers.get(b"authorization", [""])[0].strip().partition(" ")
        # compare bytes: a header read as Latin-1 may hold characters compare_digest refuses in a str
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
            return APIError(401, "Authorization: missing or wrong API key; send 'Authorization: Bearer <key>' "
                            "with the key the server was started with (--api-key)", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})

    if scope.get("method") in BODY_METHODS:
        length = headers.get(b"content-length", [""])[0].strip()  # digits under h11, which refuses any other
        has_body = (int(length) > 0 if length.isdigit() else bool(length)) or b"transfer-encoding" in headers
        if has_body:  # what a browser could have sent matters
            types = headers.get(b"content-type", [])
            bad = next((t for t in types if _media_type(t) != JSON_TYPE), None)
            if not types or bad is not None:
                got = "missing" if not types else f"{_short(bad)} is not JSON"
                return APIError(415, f"Content-Type: {got}; send the body as JSON with 'Content-Type: {JSON_TYPE}' "
                                f"(curl: -H 'Content-Type: {JSON_TYPE}')", code="unsupported_media_type")
    return None


# --------------------------------------------------------------------------- the connection guard


def raw_response(e: APIError, extra: dict[str, str] | None = None) -> bytes:
    """``e`` as a whole HTTP/1.1 response that closes the connection: written straight to a
    transport, where there is no request for the app to answer (or it cannot be parsed)."""
    body = json.dumps(e.body(), separators=(",", ":")).encode()
    try:
        reason = http.HTTPStatus(e.status).phrase
    except ValueError:
        reason = ""
    head = [f"HTTP/1.1 {e.status} {reason}", "content-type: application/json", "connection: close",
            f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in {**e.headers, **(extra or {})}.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class RefusalLog:
    """Counts refusals of one kind and logs them at most once per REFUSAL_LOG_SECONDS (a flood
    of clients must not become a flood of log lines)."""

    def __init__(self, what: str):
        self.what = what  # e.g. "refused %d connection(s)"
        self.count, self.last = 0, -math.inf

    def note(self, why: str) -> None:  # on the event loop's thread only
        self.count += 1
        now = time.monotonic()
        if now - self.last >= REFUSAL_LOG_SECONDS:
            log.warning(f"{self.what}: %s (logged at most every %g s)", self.count, why, REFUSAL_LOG_SECONDS)
            self.count, self.last = 0, now


def unread_bytes(transport: Any) -> bool:
    """Bytes wait in ``transport``'s socket that the event loop has not read yet (False where
    that cannot be asked: not POSIX, no socket)."""
    try:
        import fcntl
        import termios

        buf = array.array("i", [0])
        fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, buf)
        return buf[0] > 0
    except (ImportError, AttributeError, OSError, ValueError):
        return False


class _QuietUvicorn(logging.Filter):
    """uvicorn logs a warning for every unparsable request and every Upgrade header (we answer
    and count them ourselves, rate-limited): without this, any client can fill the log."""

    DROP = ("Invalid HTTP request received.", "Unsupported upgrade request.", "No supported WebSocket library")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.DROP)


def guarded_protocol(max_connections: int, header_timeout: float, body_timeout: float,
                     on_refused: Callable[[], None] | None = None) -> type:
    """uvicorn's h11 protocol, guarded (``on_refused()`` is called for each connection refused or
    closed to make room: /metrics counts them).

    - ``max_connections`` open, and room made for newcomers: past the limit, once the loop has
      read what the newcomers sent (two turns later), the oldest connections that carry no
      whole request are closed until ``max_connections`` are left: those that have sent
      nothing, sit idle between requests, or are still sending a head or a body (503 to these
      two), those with bytes the loop has not read yet last. A request, once whole (queued,
      running, streaming), is never closed to make room. Up to :data:`SURGE` newcomers wait for
      that read; past them, room is made at once, and a newcomer is refused (503 and close)
      only when every connection carries a request being answered. So silent or trickling
      clients cannot lock others out: each newcomer displaces them.
    - A request head must arrive whole within ``header_timeout`` seconds of the connection (or
      of its first byte, on a kept-alive one), and its body within ``body_timeout`` seconds of
      the head (app.BodyLimit answers 408 then; the connection is closed BODY_GRACE_SECONDS
      later if it has not been): totals, whatever the pace of the bytes.
    - A request h11 cannot parse is answered with a JSON error (400, or h11's hint: 431 for a
      head over 16 KiB, 501 for a transfer coding other than chunked) naming what is wrong,
      instead of uvicorn's plain text."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = raw_response(APIError(503, "server busy: too many open connections; retry later", type="server_error",
                                 code="too_many_connections"), {"retry-after": "1"})
    order = itertools.count()  # connections' ages, as an order
    trim = [False]  # a trim is scheduled
    refused = RefusalLog("refused %d connection(s)")
    displaced = RefusalLog("closed %d idle or incomplete connection(s) to make room")
    malformed = RefusalLog("answered %d malformed request(s) with an error")
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietUvicorn) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_QuietUvicorn())

    class Connection(h11.Connection):
        """h11's connection, keeping the error of a request it cannot parse (uvicorn drops it)."""

        error: Any = None

        def next_event(self) -> Any:
            try:
                return super().next_event()
            except h11.RemoteProtocolError as e:
                self.error = e
                raise

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _timer: Any = None
        _body_deadline = False  # whether _timer is the body's deadline (else the head's)
        _since = 0  # when (in `order`) this connection last carried no request: the oldest is closed first for room

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            size = self.config.h11_max_incomplete_event_size
            self.conn = Connection(h11.SERVER, **({} if size is None else {"max_incomplete_event_size": size}))

        # ---- the limit

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections + SURGE and not self._make_room():
                self._refused, self.transport = True, transport
                transport.write(busy)
                transport.close()
                refused.note(f"{max_connections} connections carry requests (--max-connections)")
                if on_refused is not None:
                    on_refused()
                return
            super().connection_made(transport)
            self._since = next(order)
            self._arm(header_timeout, body=False)
            if len(self.connections) > max_connections and not trim[0]:
                self._schedule_trim()

        def _schedule_trim(self) -> None:
            """Make room two turns of the loop from now, among the connections open now: by then
            the loop has read what they sent (asyncio's selector transport reads a newcomer in
            the turn after the one that adds its reader), so a whole request keeps its place."""
            trim[0] = True
            self.loop.call_soon(self.loop.call_soon, self._trim, next(order))

        def _trim(self, mark: int) -> None:
            trim[0] = False
            while len(self.connections) > max_connections and self._make_room(mark):
                pass
            if len(self.connections) > max_connections and self._spare(None, mark):
                self._schedule_trim()  # newer ones, not read yet at this trim

        def _spare(self, upto: int | None, after: int | None = None) -> list[GuardedH11Protocol]:
            """Open connections that carry no whole request, oldest first (of those older than
            ``upto`` / newer than ``after``)."""
            return sorted((c for c in self.connections if isinstance(c, GuardedH11Protocol) and not c._answering()
                           and (upto is None or c._since <= upto) and (after is None or c._since > after)),
                          key=lambda c: c._since)

        def _answering(self) -> bool:
            """A whole request is being answered (queued, running, streaming)."""
            return (self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.MIGHT_SWITCH_PROTOCOL)
                    and self.conn.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY))

        def _make_room(self, upto: int | None = None) -> bool:
            spare = self._spare(upto)
            if not spare:
                return False
            victim = next((c for c in spare if not unread_bytes(c.transport)), spare[0])
            victim._close(busy)
            displaced.note(f"{max_connections} connections are open (--max-connections)")
            if on_refused is not None:
                on_refused()
            return True

        def _close(self, answer: bytes | None) -> None:
            """Close now; ``answer`` is written first if a request has begun and has no response."""
            self.connections.discard(self)  # its place is free now, not when the loop gets to connection_lost
            self._disarm()
            if answer is not None and not self.transport.is_closing() and self._begun_unanswered():
                self.transport.write(answer)
            self.transport.close()

        def _begun_unanswered(self) -> bool:
            begun = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
            return begun and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)

        # ---- the deadlines

        def _arm(self, seconds: float, body: bool) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)
            self._body_deadline = body

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            state = self.conn.their_state
            if self.transport.is_closing():
                return
            if state is h11.IDLE and not self._body_deadline:  # no whole head in time: silent or slow
                late = APIError(408, f"request head: not received whole within {header_timeout:g} s "
                                "(--header-timeout); send the whole request at once", code="request_timeout")
                self._close(raw_response(late))
            elif state is h11.SEND_BODY and self._body_deadline:
                self._close(None)  # the app has answered (408, or earlier): nothing is left to say

        def _track(self) -> None:
            """The deadline that applies now, from the client's side of h11's state machine."""
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if not self._body_deadline or self._timer is None:
                    self._arm(body_timeout + BODY_GRACE_SECONDS, body=True)
            elif state is not h11.IDLE or self._body_deadline:
                self._disarm()  # a whole request (its answer is not timed here), or a closed connection

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._timer is None and self.conn.their_state is h11.IDLE:
                self._arm(header_timeout, body=False)  # the first bytes of a request on a kept-alive connection
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:
                self._since = next(order)
            self._track()  # between requests the keep-alive timeout applies

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if not self._refused:
                super().connection_lost(exc)

        # ---- malformed requests

        def send_400_response(self, msg: str) -> None:
            e = self.conn.error
            status = getattr(e, "error_status_hint", 400)
            # h11 quotes the bad line as bytearray(b'...'): the b'...' is what the client sent
            detail = " ".join(re.sub(r"bytearray\((b(['\"]).*?\2)\)", r"\1", str(e or msg)).split())
            if len(detail) > DETAIL_CHARS:
                detail = detail[: DETAIL_CHARS - 3] + "..."
            bad = APIError(status if 400 <= status < 600 else 400,
                           f"invalid HTTP request ({detail}); send a well-formed HTTP/1.1 request",
                           code="invalid_http_request")
            malformed.note(detail)
            self._disarm()
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response begun on this connection
                self.transport.write(raw_response(bad))
            self.transport.close()

    return GuardedH11Protocol
