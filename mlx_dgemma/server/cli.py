"""``mlx-dgemma serve``: the server's flags, their checks (all before the model loads), the
listening socket, and uvicorn with the connection guard (:mod:`mlx_dgemma.server.guard`).

This module imports nothing heavy at its top (``mlx-dgemma --help`` builds every parser);
the model flags (``--model``, ``--demo``, precision) are the command line's shared ones,
added by ``mlx_dgemma.cli``, which imports this module (never the reverse).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
import urllib.parse
from typing import Any

from mlx_dgemma.errors import DGemmaError, ParameterError, hold_interrupts
from mlx_dgemma.server.guard import SURGE, check_host_names, guarded_protocol, is_loopback

API_KEY_ENV = "MLX_DGEMMA_API_KEY"  # the key when --api-key is not given


def add_args(p: argparse.ArgumentParser) -> None:
    """The server's own flags (the model flags come from ``mlx_dgemma.cli``)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--queue-size", type=int, default=64,
                   help="requests that may wait for their first turn before 503 (default 64)")
    p.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="requests that take turns on the model, one block each (default 4; each holds its "
                        "own KV cache): a short request waits for a block of each, not for a long one")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MB (default 16)")
    p.add_argument("--model-id", help="the model name clients send (default: the file or directory name)")
    p.add_argument("--max-request-steps", type=int, default=4096, metavar="N",
                   help="work budget of one request: denoising steps x blocks (default 4096); an answer "
                        "asking for more blocks is capped, finish_reason 'length'")
    p.add_argument("--max-request-seconds", type=float, default=300.0, metavar="S",
                   help="stop a request's generation once it has had S seconds of the model's time, answering "
                        "what is done (the block in progress as its latest draft) with finish_reason 'length' "
                        "(default 300; 0: no limit)")
    p.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="connections kept open (default 256): past N, the oldest that carry no whole request "
                        "(silent, idle, still sending) are closed to make room; a newcomer is refused with 503 "
                        "only when every connection carries a request being answered")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$MLX_DGEMMA_API_KEY, else none)")
    p.add_argument("--cors", action="append", default=None, metavar="ORIGIN",
                   help="let browser pages from ORIGIN call the API (repeat it, or '*' for any; default: "
                        "none: a request with any other Origin is refused, so that a web page cannot drive "
                        "a local server)")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME",
                   help="answer requests whose Host header is NAME (repeat it, or '*' for any): on a loopback "
                        "--host only localhost, 127.x.x.x and [::1] are answered by default (against DNS "
                        "rebinding); on another --host every name is, unless this is given")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request head must arrive whole within S seconds, else the connection is closed "
                        "(default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body must arrive whole within S seconds of its head, else 408 and the "
                        "connection is closed (default 30)")


def check_args(args: argparse.Namespace) -> None:
    """Every server flag, before the model loads: a bad one is a one-line error naming it."""
    def finite(flag: str, v: float, low: float, high: float) -> None:
        if not (math.isfinite(v) and low <= v <= high):
            raise ParameterError(f"{flag} {v}: must be a number in [{low:g}, {high:g}]")

    if not 0 <= args.port <= 65535:  # before the model loads, not as bind()'s own words after it
        raise ParameterError(f"--port {args.port}: must be a port number in [0, 65535] (0 picks a free one)")
    if args.queue_size < 1:
        raise ParameterError(f"--queue-size {args.queue_size}: must be at least 1")
    finite("--max-body-mb", args.max_body_mb, 0.001, 1e6)
    if args.max_request_steps < 1:
        raise ParameterError(f"--max-request-steps {args.max_request_steps}: must be at least 1")
    if args.parallel < 1:
        raise ParameterError(f"--parallel {args.parallel}: must be at least 1")
    if args.max_request_seconds is not None:
        finite("--max-request-seconds", args.max_request_seconds, 0, 1e9)
    if args.max_connections < 1:
        raise ParameterError(f"--max-connections {args.max_connections}: must be at least 1")
    finite("--header-timeout", args.header_timeout, 0.1, 3600)
    finite("--body-timeout", args.body_timeout, 0.1, 3600)
    try:
        check_host_names(args.allowed_hosts or [])
    except ValueError as e:
        raise ParameterError(f"--allowed-hosts {e}: must be a host name or address as clients type it (no scheme, "
                             "port or path), or '*' for any") from None
    if not args.host.strip():  # bind("") is every interface: never what an empty value meant
        raise ParameterError(f"--host {args.host!r}: an empty address; give 127.0.0.1 (this machine only, the "
                             "default) or 0.0.0.0 (every network interface)")
    source = "--api-key"
    if args.api_key is None and API_KEY_ENV in os.environ:  # set, even empty: checked like the flag
        args.api_key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    key = args.api_key
    if key is not None and not key.strip():  # an empty key must not mean "no key" without a word
        raise ParameterError(f"{source}: empty; give the key clients must send"
                             + (f", or unset {API_KEY_ENV} to serve without one" if source != "--api-key" else ""))
    # HTTP trims a header's ends, and clients send non-ASCII header values as UTF-8 (curl), refuse
    # them (httpx, the openai client) or as Latin-1 (requests): such a key would lock most clients out
    if key is not None and (not key.isprintable() or not key.isascii() or key != key.strip()):
        raise ParameterError(f"{source}: must be a non-empty printable ASCII string without spaces at its ends")
    for origin in args.cors or ():
        if origin == "*":
            continue
        # a browser's Origin header is scheme://host[:port], nothing after: "http://a.example/" never matches
        u = urllib.parse.urlsplit(origin)
        if u.scheme not in ("http", "https") or not u.netloc or u.path or u.query or u.fragment:
            bare = f"{u.scheme}://{u.netloc}" if u.scheme in ("http", "https") and u.netloc else "http://localhost:3000"
            raise ParameterError(f"--cors {origin}: must be '*' or an origin (scheme://host[:port], no path), "
                                 f"such as {bare}")


def host_warning(host: str, api_key: str | None) -> str | None:
    """A line for a server reachable from other machines without a key, else None."""
    if api_key is None and not is_loopback(host):
        return (f"mlx-dgemma serve: warning: listening on {host} without --api-key: anyone who can reach "
                "this port can use the model")
    return None


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        raise ParameterError(f"--host/--port: cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e}); "
                             "choose another port or address") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _raise_fd_limit(connections: int) -> None:
    """Open files: room for ``connections`` and the guard's surge of newcomers, plus the model's
    files and the log (raised up to the hard limit); where that is not possible, refuse the flag:
    past the limit every accept fails and asyncio logs each failure, thousands of lines a second."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    want = connections + SURGE + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < want:
        raise ParameterError(f"--max-connections {connections}: this process may open only {target} files "
                             f"(ulimit -n); lower --max-connections to at most {max(1, target - SURGE - 64)} "
                             "or raise the limit")


def _settings(args: argparse.Namespace) -> tuple[Any, Any]:
    from .app import Settings
    from .engine import Limits

    limits = Limits(queue_size=args.queue_size, max_request_steps=args.max_request_steps,
                    max_request_seconds=args.max_request_seconds or None, parallel=args.parallel)
    # the Host is checked on a loopback bind (DNS rebinding), elsewhere only where names are given
    hosts = check_host_names(args.allowed_hosts or [])
    settings = Settings(max_body_bytes=int(args.max_body_mb * (1 << 20)), body_timeout=args.body_timeout,
                        api_key=args.api_key, cors_origins=tuple(args.cors or ()),
                        allowed_hosts=hosts if hosts or is_loopback(args.host) else None)
    return limits, settings


def _memory_limit(args: argparse.Namespace) -> int | None:
    """--memory-limit in bytes (checked by the memory plan before this), or None."""
    from mlx_dgemma.plan import parse_size

    return parse_size(args.memory_limit) if getattr(args, "memory_limit", None) else None


def follow(args: argparse.Namespace) -> int:
    """A rank > 0 of ``serve`` under ``mlx.launch``: load this rank's slices of the model and run
    every model call rank 0's server makes (``ModelRuntime.follow``) until it shuts down.

    Ctrl+C reaches every local rank: this one ignores it and leaves when rank 0, which stops
    on it, says so (rank 0 gone without a word: the ring's connection breaks and the
    launcher ends the other ranks)."""
    import signal

    from mlx_dgemma.lockstep import run_follower

    from .engine import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_follower(load_model(args.model, args.demo, args.dtype, args.precision, _memory_limit(args),
                            getattr(args, "plan", None)), "serve")


def main(args: argparse.Namespace) -> int:
    """``mlx-dgemma serve``: check the flags, listen, load the model, serve until interrupted."""
    check_args(args)  # --api-key, else $MLX_DGEMMA_API_KEY
    from mlx_dgemma.loader import check_model_choice

    check_model_choice(args.model, args.demo)
    from mlx_dgemma.launch import launched, launched_rank

    if launched() and launched_rank() > 0:  # under mlx.launch: rank 0 serves, this rank follows it
        return follow(args)
    # Ctrl+C is held while this thread imports and builds (see hold_interrupts: an interrupt
    # lost there started the server anyway), and acts at once while it waits for the load
    with hold_interrupts():
        limits, settings = _settings(args)
        _raise_fd_limit(args.max_connections)
        sock = listen(args.host, args.port)  # before loading: a taken port fails fast
        import uvicorn

        from .app import create_app
        from .engine import Engine

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
        engine = Engine(args.model, args.demo, args.dtype, args.precision, args.model_id, limits,
                        memory_limit=_memory_limit(args), plan=getattr(args, "plan", None))
    try:
        engine.start()
    except DGemmaError as e:
        if getattr(args, "debug", False):
            raise
        # exit here, not through the interpreter's shutdown: MLX state created by the worker
        # thread can abort it ("terminate called without an active exception"), see below
        print(f"mlx-dgemma serve: error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)

    import signal
    import threading
    from collections.abc import Iterator
    from contextlib import contextmanager

    from mlx_dgemma.errors import raising_signals

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:  # the first signal: answer every open request now
                engine.begin_shutdown()
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # SIGHUP stops the server as SIGTERM does (uvicorn takes SIGINT and SIGTERM only): left
            # to terminate_as_interrupt's handler it raised inside whatever the event loop ran (a
            # traceback; once inside a request's log call, and the server ran on) and streams were
            # cut off without their shutdown event. uvicorn raises it again once stopped, which
            # main's `except KeyboardInterrupt` takes. An ignored SIGHUP (nohup) stays ignored.
            with super().capture_signals():
                hup = getattr(signal, "SIGHUP", None)
                if threading.current_thread() is not threading.main_thread() or hup not in raising_signals():
                    yield
                    return
                old = signal.signal(hup, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(hup, old)

    try:
        with hold_interrupts():  # until uvicorn takes the signals over in server.run
            app = create_app(engine, settings)
            # keep-alive 30 s: clients that reuse a connection between turns rarely find it closed;
            # no WebSocket protocol: an upgraded connection would leave the guard (limit, deadlines)
            config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                                    timeout_keep_alive=30, ws="none",
                                    http=guarded_protocol(args.max_connections, args.header_timeout,
                                                          args.body_timeout, engine.connection_refused))
            config.load()  # its imports (protocols, loop) here, not in server.run before the signals are taken
            server = Server(config)
    except KeyboardInterrupt:
        engine.stop()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    warning = host_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(f"mlx-dgemma serve: {engine.model_id} ({engine.precision}) on http://{shown}:{port}/v1 (Ctrl+C to stop)",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal that stopped it: the stop was clean
        pass
    finally:
        engine.stop()
        print("mlx-dgemma serve: stopped", file=sys.stderr, flush=True)
        logging.shutdown()
        # Nothing is left to write, and C++ static destructors racing the MLX worker thread's
        # state at interpreter exit aborted 3 of 11 Ctrl+C stops ("terminate called without an
        # active exception", status 134): leave without them.
        sys.stdout.flush()
        os._exit(0)
