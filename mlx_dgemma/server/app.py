"""The FastAPI application: routes, the error handlers, the request log, the request guard
(:mod:`mlx_dgemma.server.guard`'s rules: Host, Origin, API key, Content-Type) and the body limit.

The :class:`~mlx_dgemma.server.engine.Engine` lives in ``app.state.engine`` and reaches the
routes through ``Depends(get_engine)``; the lifespan starts it (unless the command line
already has, to report a load error as one line before listening) and stops it (cancels
the running and waiting jobs, joins the worker). Request bodies are pydantic models
(:mod:`mlx_dgemma.server.schemas`); one handler turns every validation error into the
OpenAI-style 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from .endpoints import ENDPOINTS, V1, Endpoint, Shaped
from .engine import Engine, Job
from .errors import APIError
from .guard import refusal
from .openai import Deltas, Formatter, model_card, sse
from .schemas import Sampling

log = logging.getLogger("mlx_dgemma.server")

MAX_DRAIN_BYTES = 256 << 20  # an oversized body is read and dropped up to this size, then the connection closed
RAW_BODY = "mlx_dgemma.body"  # scope key: the request body as received (the validation handler reads it)
LOG_INFO = "mlx_dgemma.log"  # scope key: what the request's log line reports


@dataclass(frozen=True)
class Settings:
    """The HTTP side's settings (the command line's flags)."""

    max_body_bytes: int = 16 << 20
    body_timeout: float = 30.0  # a request body not received whole this long after its head is answered 408
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on every route but /health
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from (none: CORS off, any Origin refused)
    # Host names answered besides loopback ones (None: any Host; the command line checks it on a loopback bind)
    allowed_hosts: tuple[str, ...] | None = None


def get_engine(request: Request) -> Engine:
    """The running engine (``Depends`` target)."""
    return request.app.state.engine


def _log_info(request: Request) -> dict[str, Any]:
    return request.scope.setdefault(LOG_INFO, {})


# --------------------------------------------------------------------------- errors


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


ROUTES = (", ".join([f"{V1}/models", *(e.path for e in ENDPOINTS if len(e.paths) > 1)]) + f" (each also without {V1}), "
          + ", ".join([*(e.path for e in ENDPOINTS if len(e.paths) == 1), "/props", "/health", "/metrics"]))


def validation_error(exc: RequestValidationError, raw: bytes | None, model: type | None = None) -> APIError:
    """The first problem of a request body as the 400 that names its field, in our words
    (:func:`_in_our_words`). With the body's ``model``, the error is the first of that model's
    own validation (the field a client got before FastAPI validated the bodies)."""
    err = exc.errors()[0]
    if model is not None and isinstance(exc.body, dict):
        try:
            model.model_validate(exc.body)
        except ValidationError as e:
            err = {**e.errors(include_url=False)[0], "loc": ("body", *e.errors(include_url=False)[0]["loc"])}
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        doc = exc.body if isinstance(exc.body, str) else ""
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        detail = json.JSONDecodeError(err.get("ctx", {}).get("error", "invalid JSON"), doc, pos)
        return APIError(400, f"body: not valid JSON ({detail}); send a JSON object")
    if loc and loc[0] == "body":
        loc = loc[1:]
    if not loc:  # the body itself: empty, or not an object
        if not raw:
            return APIError(400, "body: empty; send a JSON object")
        return APIError(400, f"body: expected a JSON object, got {type(err.get('input')).__name__}")
    param = _param(loc)
    return APIError(400, f"{param}: {_in_our_words(err)}", param=param)


# pydantic's error types in our words: what was expected, and what came
_EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
             "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
             "bool_parsing": "true or false", "string_type": "a string", "list_type": "a list",
             "dict_type": "a JSON object", "model_type": "a JSON object", "model_attributes_type": "a JSON object"}
_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "more than"),
           "less_than_equal": ("le", "at most"), "less_than": ("lt", "less than")}


def _json(value: Any) -> str:
    """A value as the client sent it (JSON), shortened."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _in_our_words(err: Any) -> str:
    """One pydantic error (a field's) as the server says it: our validators' own words, the
    registry's rule for a sampler field (:mod:`.schemas`), and for the rest what was expected
    and what came, never pydantic's wording."""
    kind, ctx, got = err.get("type"), err.get("ctx") or {}, err.get("input")
    if kind == "value_error":
        return str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_json(got)}"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {_json(got)}"
    if kind == "missing":
        return "required; send it"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"must be {words} {ctx.get(key)}, got {_json(got)}"
    if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        unit = "character(s)" if kind.startswith("string") else "item(s)"
        limit = ctx.get("min_length") if kind.endswith("short") else ctx.get("max_length")
        return f"expected {'at least' if kind.endswith('short') else 'at most'} {limit} {unit}"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}, got {_json(got)}"
    if kind in ("finite_number", "float_finite"):
        return "must be a finite number (NaN and Infinity are not JSON values)"
    return str(err.get("msg", "invalid"))


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    _log_info(request)["error"] = e.code or e.param or e.type
    return _error(e)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    model = request.app.state.body_models.get(request.url.path)  # the body this POST route validates
    return await _api_error(request, validation_error(e, request.scope.get(RAW_BODY), model))


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 404:
        return _error(APIError(404, f"{request.method} {request.url.path}: no such route; see {ROUTES}",
                               code="unknown_url"))
    if e.status_code == 405:  # Starlette's exception carries the route's methods (RFC 9110: Allow)
        allow = dict(e.headers or {})
        methods = allow.get("Allow") or allow.get("allow")
        return _error(APIError(405, f"{request.method} {request.url.path}: method not allowed"
                               + (f"; this route takes {methods}" if methods else ""),
                               code="method_not_allowed", headers=allow))
    if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not decode the body
        return await _api_error(request, APIError(400, f"body: not valid JSON ({e.__cause__}); send a JSON object"))
    return _error(APIError(e.status_code, str(e.detail)))


# --------------------------------------------------------------------------- middleware


class CORS(CORSMiddleware):
    """Starlette's CORS, but a refused preflight (still 400) is answered like every other error
    of the server: an OpenAI-style JSON object, not Starlette's plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        failed = bytes(response.body).decode().removeprefix("Disallowed CORS ")  # e.g. "origin, method"
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return _error(APIError(400, f"CORS preflight: disallowed {failed}; browsers may call this server only "
                               "from the origins it was started with (--cors), with GET, HEAD or POST",
                               code="cors_disallowed", headers=headers))


class RequestLog:
    """Outermost: one log line per request, and no exception ever reaches the server (an
    unexpected one is answered 500 and logged once; a client that vanished mid-response is
    logged, not raised)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status: list[int | None] = [None]
        info: dict[str, Any] = scope.setdefault(LOG_INFO, {})

        async def _send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        except asyncio.CancelledError:  # shutdown past its grace period: the connection just closes
            info.setdefault("error", "shutdown")
        except Exception as e:  # noqa: BLE001 - a bug, or the client gone mid-response
            info.setdefault("error", type(e).__name__)
            if status[0] is None:
                log.exception("internal error")
                err = APIError(500, f"internal error: {type(e).__name__}; see the server log", type="server_error")
                try:
                    await _error(err)(scope, receive, _send)
                except Exception:  # noqa: BLE001 - the client is gone too
                    pass
        finally:
            job: Job | None = info.get("job")
            if job is not None and job.submitted and not job.finished.is_set():
                # the response ended before the worker finished: if before the answer (the client
                # left, or a failure) stop it at the next step; log how far it got
                if not job.answered:
                    job.cancel.set()
                try:
                    await asyncio.wait_for(job.finished.wait(), 60)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
            fields = [f"{k}={v}" for k, v in (job.stats if job else {}).items() if v is not None]
            if "error" in info:
                fields.append(f"error={info['error']}")
            engine = getattr(getattr(scope.get("app"), "state", None), "engine", None)
            if isinstance(engine, Engine) and status[0] is not None and 400 <= status[0] < 500:
                engine.rejected()  # (an app built on a stand-in engine counts nothing)
            if scope.get("path") == "/health" and scope.get("method") in ("GET", "HEAD") and status[0] in (200, 503):
                return  # probes every few seconds would bury the requests' lines
            log.info("%s %s %s %.3fs %s", scope.get("method"), scope.get("path"), status[0] or "-",
                     time.perf_counter() - t0, " ".join(fields))


class Guard:
    """Before routing and before the body is read: a request that ``guard.refusal`` refuses
    (Host, Origin, API key, Content-Type) is answered with its error; inside CORS, so that a
    preflight is answered by CORS and an allowed page can read a 401."""

    def __init__(self, app: Any, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            s = self.settings
            e = refusal(scope, allowed_hosts=s.allowed_hosts, origins=s.cors_origins, api_key=s.api_key)
            if e is not None:
                scope.setdefault(LOG_INFO, {})["error"] = e.code
                return await _error(e)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request body up to ``max_body_bytes`` before routing: beyond it, 413 (the rest
    is read and dropped so that the client can read the answer; past MAX_DRAIN_BYTES the
    connection is closed). The whole body must arrive within ``body_timeout`` seconds (a total,
    not a gap between bytes: 408). The body is then replayed to the app."""

    def __init__(self, app: Any, max_body_bytes: int, body_timeout: float):
        self.app, self.limit, self.body_timeout = app, max_body_bytes, body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        too_big = bool(declared.isdigit() and int(declared) > self.limit)
        body = bytearray()
        seen = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        whole = False
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                if too_big:  # what the client must hear is the size, not the pace
                    break
                e = APIError(408, f"body: not received whole within {self.body_timeout:g} s (--body-timeout); "
                             "send the whole body at once", code="request_timeout")
                scope.setdefault(LOG_INFO, {})["error"] = e.code
                response = _error(e)
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            too_big = too_big or seen > self.limit
            if not too_big:
                body += chunk
            elif seen > MAX_DRAIN_BYTES:
                break
            if not message.get("more_body", False):
                whole = True
                break
        if too_big:
            e = APIError(413, f"body: {max(seen, int(declared or 0))} bytes is over the limit of {self.limit}; "
                         "send a smaller request (or start the server with a larger --max-body-mb)",
                         code="body_too_large")
            scope.setdefault(LOG_INFO, {})["error"] = e.code
            response = _error(e)
            if not whole:  # the rest is not read
                response.headers["connection"] = "close"
            return await response(scope, receive, send)
        scope[RAW_BODY] = bytes(body)
        replayed = False

        async def _receive() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, _receive, send)


# --------------------------------------------------------------------------- routes

router = APIRouter()
open_router = APIRouter()  # no key needed (guard.OPEN_PATHS): liveness probes


@open_router.api_route("/health", methods=["GET", "HEAD"])
async def health(engine: Engine = Depends(get_engine)) -> JSONResponse:
    """200 ``ok`` once the model is loaded and warmed up; 503 ``loading`` before, ``down`` after a stop."""
    alive = engine.alive
    status = "down" if not alive else "ok" if engine.ready.is_set() else "loading"
    # the model's facts both front ends show (ModelInfo.shown: the precision), null before the load
    return JSONResponse({"status": status, "model": engine.model_id, **engine.host.shown(),
                         "busy": engine.busy, "running": engine.worker.in_progress,
                         "queued": engine.waiting, "served": engine.served,
                         "reused_prefixes": engine.reused_prefixes, "memory_bytes": engine.host.memory_bytes},
                        status_code=200 if status == "ok" else 503)


def _card(engine: Engine) -> dict[str, Any]:
    return model_card(engine.model_id, engine.created, engine.context)


@router.api_route("/v1/models", methods=["GET", "HEAD"])
@router.api_route("/models", methods=["GET", "HEAD"], include_in_schema=False)
async def models(engine: Engine = Depends(get_engine)) -> dict[str, Any]:
    return {"object": "list", "data": [_card(engine)]}


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(engine: Engine = Depends(get_engine)) -> Response:
    """Prometheus text format: the engine's counters, gauges and latency histograms."""
    return Response(engine.metrics_text(), media_type="text/plain; version=0.0.4")


@router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
@router.api_route("/models/{model_id:path}", methods=["GET", "HEAD"], include_in_schema=False)
async def model(model_id: str, engine: Engine = Depends(get_engine)) -> dict[str, Any]:
    """Any name: the one model answers every name (chat and completions accept any, clients
    hard-code names and look them up first)."""
    return _card(engine)


@router.api_route("/props", methods=["GET", "HEAD"])
async def props(engine: Engine = Depends(get_engine)) -> dict[str, Any]:
    """llama.cpp's server properties (what editors read the context length from), with the
    diffusion model's own: its canvas, the sampler's defaults, the server's limits."""
    lim = engine.limits
    return {"model_alias": engine.model_id, "model_path": engine.model_path or engine.model_id,
            "total_slots": engine.worker.max_running, "chat_template": engine.tokenizer.chat_template or "",
            "default_generation_settings": {"n_ctx": engine.context, "model": engine.model_id,
                                            "params": {k: v for k, v in engine.generation_config.items()
                                                       if isinstance(v, (int, float, str, bool, list))}},
            "modalities": {"vision": False, "audio": False},
            "diffusion": {"canvas_length": engine.canvas, "precision": engine.precision,
                          "max_request_steps": lim.max_request_steps, "max_request_seconds": lim.max_request_seconds,
                          "parallel": engine.worker.max_running, "queue_size": lim.queue_size}}


@router.api_route("/v1/responses", methods=["GET", "POST"])
@router.api_route("/responses", methods=["GET", "POST"], include_in_schema=False)
async def responses() -> None:
    """OpenAI's Responses API is not served: its state (stored responses, previous_response_id)
    and its streaming event protocol are a second API; half of one would mislead an agent
    framework more than a clear pointer to the one that is complete here."""
    raise APIError(404, "/v1/responses: the Responses API is not served here; use /v1/chat/completions (openai-agents: "
                   "set_default_openai_api('chat_completions') or OpenAIChatCompletionsModel; other clients: their "
                   "chat-completions or 'openai-compatible' provider)", code="unknown_url")


def generating_route(endpoint: Endpoint) -> Callable[..., Any]:
    """The route function of a generating endpoint: its body shaped on a handler thread (the
    template, the tokenizer), then submitted as a job and answered by the endpoint's formatter."""

    async def generate(body: Sampling, request: Request, engine: Engine = Depends(get_engine)) -> Response:
        # any model name is served by the one model (clients hard-code names); responses name ours
        shaped = await run_in_threadpool(endpoint.shape, engine, body)
        return await _submit(request, engine, endpoint, body, shaped)

    generate.__annotations__ = {**generate.__annotations__, "body": endpoint.body}  # what FastAPI validates
    generate.__name__ = generate.__qualname__ = endpoint.shape.__name__.removeprefix("shape_")
    return generate


def generating_router(endpoints: tuple[Endpoint, ...]) -> APIRouter:
    """``POST`` routes for ``endpoints``: each path, and the same without ``/v1``."""
    out = APIRouter()
    for endpoint in endpoints:
        route = generating_route(endpoint)
        for i, path in enumerate(endpoint.paths):
            out.add_api_route(path, route, methods=["POST"], include_in_schema=i == 0)
    return out


async def _submit(request: Request, engine: Engine, endpoint: Endpoint, body: Sampling, shaped: Shaped) -> Response:
    # the answer's exact token limit: the client's max_tokens, lowered where the context capped it
    max_tokens = shaped.request.get("max_new_tokens")
    job = Job(shaped.kind, shaped.prompt, shaped.request, max_tokens, body.stop, shaped.thinking,
              bool(body.diffusion and body.diffusion.stream_steps), asyncio.get_running_loop(), tools=shaped.tools,
              logprobs=shaped.logprobs, forced=shaped.forced, continued=shaped.continued)
    fmt = endpoint.formatter(engine.model_id)
    job.stats["id"] = fmt.id  # the log line names the response's id
    _log_info(request)["job"] = job
    engine.submit(job)
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(job, fmt, watcher, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        while True:
            what, payload = await job.queue.get()
            if what == "error":
                raise payload
            if what == "gone" or what == "done" and payload is None:
                return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
            if what == "done":
                return JSONResponse(fmt.final(payload))
    finally:
        if not job.answered:  # this handler was cancelled: stop the worker at its next step
            job.cancel.set()
        watcher.cancel()


async def _stream(job: Job, fmt: Formatter, watcher: asyncio.Task, include_usage: bool) -> AsyncIterator[str]:
    content, reasoning = Deltas(), Deltas()
    calls_sent = 0  # a tool call goes out whole, once the block holding its end is committed
    lp_sent = 0  # logprobs entries sent (each goes out once its block is committed)

    def new_calls(calls: tuple) -> list[tuple[int, Any]]:
        nonlocal calls_sent
        out = list(enumerate(calls))[calls_sent:]
        calls_sent = max(calls_sent, len(calls))
        return out

    def new_logprobs(entries: tuple | None) -> tuple | None:
        nonlocal lp_sent
        if not entries or len(entries) <= lp_sent:
            return None
        out, lp_sent = entries[lp_sent:], len(entries)
        return out

    try:
        for chunk in fmt.opening():
            yield sse(chunk)
        while True:
            what, payload = await job.queue.get()
            if what == "step":
                yield sse(fmt.extra(diffusion=payload))
            elif what == "text":
                dc, dr = content(payload[0]), reasoning(payload[1])
                lp = new_logprobs(payload[3])
                if dc or dr or lp:
                    yield sse(fmt.delta(dc, dr, logprobs=lp))
                calls = new_calls(payload[2])
                if calls:
                    yield sse(fmt.delta(tool_calls=calls))
            elif what == "done":
                if payload is None:
                    return
                dc, dr = content(payload.content), reasoning(payload.reasoning)
                lp = new_logprobs(payload.logprobs)
                if dc or dr or lp:
                    yield sse(fmt.delta(dc, dr, logprobs=lp))
                calls = new_calls(payload.tool_calls)
                if calls:
                    yield sse(fmt.delta(tool_calls=calls))
                # the timings go in the stream's last chunk (llama.cpp's place for them)
                timings = {"timings": payload.timings} if payload.timings is not None else {}
                yield sse({**fmt.delta(finish=payload.finish_reason, detail=payload.finish_detail),
                           **({} if include_usage else timings)})
                if include_usage:
                    yield sse({**fmt.extra(), "usage": payload.usage, **timings})
                yield "data: [DONE]\n\n"
                return
            elif what == "error":
                job.stats["error"] = payload.code or payload.type
                yield sse(payload.body())
                yield "data: [DONE]\n\n"
                return
            elif what == "gone":
                return
    finally:
        if not job.answered:  # the stream ended early (client gone): stop at the next step
            job.cancel.set()
        watcher.cancel()


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` when the client goes away (the worker stops at its next step)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel.set()
                job.queue.put_nowait(("gone", None))
                return
    except Exception:  # noqa: BLE001 - the connection is gone either way
        job.cancel.set()


# --------------------------------------------------------------------------- the app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine (if the command line has not) and, at shutdown, stop it: the running
    and waiting jobs are cancelled at their next step and the worker thread is joined."""
    engine: Engine = app.state.engine
    if not engine.worker.started:
        await run_in_threadpool(engine.start)
    try:
        yield
    finally:
        await run_in_threadpool(engine.stop)


def create_app(engine: Engine, settings: Settings | None = None,
               endpoints: tuple[Endpoint, ...] = ENDPOINTS) -> FastAPI:
    """The FastAPI application serving ``engine`` (started here if it is not yet), with a route
    for each of the generating ``endpoints`` (:data:`~.endpoints.ENDPOINTS`)."""
    settings = settings or Settings()
    app = FastAPI(title="mlx-dgemma", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.state.settings = settings
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(open_router)
    app.include_router(router)
    app.include_router(generating_router(endpoints))
    app.state.body_models = {path: e.body for e in endpoints for path in e.paths}
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes, body_timeout=settings.body_timeout)
    app.add_middleware(Guard, settings=settings)
    if settings.cors_origins:
        app.add_middleware(CORS, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "HEAD", "POST", "OPTIONS"], allow_headers=["*"], max_age=600)
    app.add_middleware(RequestLog)  # added last: the outermost of ours
    return app
