"""The server's side of the model: requests run on its :class:`~mlx_dgemma.host.ModelHost`'s
worker (the one thread that owns the model), taking turns at
block boundaries, and reported to each request's event loop as they go. The checks and the
shaping of a request before it gets here are :mod:`.shaping`'s; forced tool calls are
:mod:`.toolcalls`'; an answer's clock and /metrics' text :mod:`.metrics`'; its logprobs entries
and step events :mod:`.payloads`'.

A chat request whose messages extend the previous conversation continues that
:class:`~mlx_dgemma.ChatSession`, so only the new turn is prefilled.

Fair sharing: a request's generation is a generator that the worker advances one block (or one
prefill chunk) per turn; after each turn it goes to the back of the worker's rotation, so up to
``Limits.parallel`` requests take turns and a short request waits for one block of each running
one, not for the whole of a long one (under ``mlx.launch`` one at a time: every rank must run
the same generation). Each request holds its own KV cache while it takes turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Mapping

from mlx_dgemma.chat_template import TOOL_CALL_CLOSE, ToolCall, parse_answer, render_chat
from mlx_dgemma.errors import DGemmaError
from mlx_dgemma.host import ModelHost, ModelInfo
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.worker import Ticket, WorkerBusy, WorkerStopped

from . import toolcalls
from .errors import APIError
from .metrics import METRICS, Histogram, Timings, prometheus_text
from .openai import Answer, Result, marker_ids
from .payloads import block_payload, logprob_entry, step_payload
from .shaping import Limits, Shaping, normalize_messages, plain_chat, tools_for  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from mlx_dgemma.plan import Plan
    from mlx_dgemma.runtime import Runtime

log = logging.getLogger("mlx_dgemma.server")

DEMO_MODEL_ID = "mlx-dgemma-demo"
WARM_UP_STEPS = 2  # the warm-up's steps: the first traces the step without self-conditioning, the second with it


@dataclass
class Job:
    """One request, as the worker sees it; results go to ``queue`` on the request's loop."""

    kind: Literal["chat", "completion"]  # the prompt's form (endpoints.Shaped), whatever endpoint shaped it
    prompt: Any  # normalized messages (chat) or token ids (completion)
    request: GenerationRequest  # the sampler's settings (and log-probabilities), checked and capped to fit
    max_tokens: int | None
    stop: tuple[str, ...]
    enable_thinking: bool
    stream_steps: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: dict[str, Any] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # the worker is done with it
    submitted: bool = False  # it reached the worker's queue (a refused job never will)
    answered: bool = False  # the result was emitted (the worker may still be committing the cache)
    started: float = 0.0  # perf_counter when the worker gave it its first turn
    tools: list[dict[str, Any]] | None = None  # declared to the template; the answer's calls are parsed
    logprobs: int | None = None  # report the answer's log-probabilities, with this many top tokens each
    forced: toolcalls.Forced | None = None  # tool_choice named or "required": the answer is a call
    continued: bool = False  # the last message is the assistant's: the answer goes on with it
    submitted_at: float = 0.0  # perf_counter when it was queued
    model_s: float = 0.0  # the model's time it has had, over its turns (--max-request-seconds counts this)
    turn_started: float = 0.0
    work: Iterator[None] | None = None  # its generation, one block per turn

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (shutdown): stop generating
            self.cancel.set()

    def release(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.finished.set)
        except RuntimeError:
            pass


def load_model(model: str | None, demo: bool, dtype: str | None, precision: str,
               memory_limit: int | None = None, plan: Plan | None = None) -> Runtime:
    """The one place the server loads a model: the core's ``open_model`` (``--model`` or
    ``--demo``, ``--precision``, ``--dtype`` and ``--memory-limit``: the plan's and every
    request's memory budget; ``plan``: the command line's, read by the load), with a loading bar."""
    from mlx_dgemma.loader import open_model
    from mlx_dgemma.progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name),
                      memory_limit=memory_limit, plan=plan)


def model_id_of(path: str | None) -> str:
    from pathlib import Path

    if not path:
        return "mlx-dgemma"
    p = Path(path).expanduser()
    return p.stem if p.suffix == ".gguf" else p.name


class Engine(Shaping):
    """The server's requests on the model: its :class:`~mlx_dgemma.host.ModelHost` (the model on
    its worker thread, its facts, its memory) and what requests need to know.

    ``model`` and ``tokenizer`` are read by request handlers only for pure-Python work
    (chat template, tokenizer, sizes); every MLX call happens on the worker.
    """

    def __init__(self, model_path: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto", model_id: str | None = None, limits: Limits | None = None,
                 memory_limit: int | None = None, plan: Plan | None = None):
        self.limits = limits or Limits()
        self.memory_limit = memory_limit  # --memory-limit: the load's and every request's budget
        self.plan = plan  # the command line's memory plan: the load reads the model it opened
        self.model_path, self.demo, self.dtype_name, self.precision_name = model_path, demo, dtype, precision
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_token_bytes = 1  # the longest token's text in UTF-8 bytes: a prompt's least token count
        self.markers: tuple[int | None, int | None] = (None, None)
        self.model_id = model_id or (DEMO_MODEL_ID if demo else model_id_of(model_path))
        self.created = int(time.time())
        self.served = 0
        self.reused_prefixes = 0
        self.stopping = False
        self.ready = threading.Event()  # loaded and warmed up: /health says ok from then on
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "steps": 0,
                       "cancelled": 0, "refused": 0, "connections_refused": 0, "tool_repairs": 0, "rejected": 0}
        self.latency = {"queue": Histogram(), "first_block": Histogram(), "total": Histogram()}
        self._session: Any = None  # the last conversation's ChatSession, if reusable
        self._session_busy = False  # a running request is using the session (others render afresh)
        self.runtime: Any = None  # the core's ModelRuntime: every rank runs the model calls (lockstep)
        self._durations: deque[float] = deque(maxlen=32)  # seconds of recent jobs (for Retry-After)
        self.host = ModelHost(self._load, max_waiting=self.limits.queue_size, name="mlx-dgemma-engine",
                              finish=self._finish)
        self.worker = self.host.worker

    # lifecycle ------------------------------------------------------------
    def start(self, warm_up: bool = True) -> "Engine":
        """Start the worker and wait until the model is loaded (load errors are raised here); then
        queue the warm-up (:meth:`warm_up`), which requests wait behind. ``ready`` is set once it ran."""
        self.worker.start()
        if warm_up:
            self.warm_up()
        else:
            self.ready.set()
        return self

    def warm_up(self) -> None:
        """Run one short answer on the worker before saying ready: MLX traces the step's graphs
        (without and with self-conditioning) and compiles its kernels there, so the first
        request does not pay for it (54 s against 4 s warm, on a fresh kernel cache). A failure
        is logged; the server is ready all the same."""
        generate = self.runtime.generate  # the runtime's own, whatever a test later puts in its place

        def run(ticket: Ticket) -> None:
            t0 = time.perf_counter()
            try:
                text = render_chat([{"role": "user", "content": "Hello"}], self.tokenizer.chat_template)
                request = GenerationRequest.of({"max_new_tokens": self.canvas, "max_denoising_steps": WARM_UP_STEPS,
                                                "seed": 0})
                for _ in generate(self.tokenizer.encode(text), request=request, chat=False,
                                  cancel=ticket.cancel_event.is_set):
                    pass
                log.info("warmed up in %.2fs", time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - a server that cannot warm up can still answer
                log.exception("warm-up failed")
            finally:
                self.ready.set()

        try:
            self.host.submit(run, skipped=lambda t: self.ready.set(), bypass_limit=True)
        except WorkerStopped:
            self.ready.set()

    def begin_shutdown(self) -> None:
        """The server is stopping: new requests get a 503, running and waiting ones stop at their
        next step and are answered with a final error (a stream ends with an error event)."""
        self.stopping = True
        self.host.cancel_all()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel the running and waiting jobs at their next step and end the worker (bounded)."""
        return self.host.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.host.alive

    @property
    def busy(self) -> bool:
        return self.host.busy

    @property
    def waiting(self) -> int:
        return self.host.waiting

    # the loaded model's facts, read from the host's ModelInfo (declared there once; 0 and {}
    # before the load)
    @property
    def canvas(self) -> int:
        return self.host.info.canvas_length if self.host.info is not None else 0

    @property
    def context(self) -> int:
        return self.host.info.context_length if self.host.info is not None else 0

    @property
    def generation_config(self) -> Mapping[str, Any]:
        return self.host.info.generation_config if self.host.info is not None else {}

    @property
    def precision(self) -> str:
        """What was loaded, e.g. "fast (bfloat16)" ("" before the load): the host's :class:`ModelInfo`."""
        return self.host.info.precision if self.host.info is not None else ""

    def _load(self) -> ModelInfo:
        from mlx_dgemma.lockstep import ModelRuntime

        loaded = load_model(self.model_path, self.demo, self.dtype_name, self.precision_name, self.memory_limit,
                            self.plan)
        info = ModelInfo.of(loaded, self.model_id)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.max_token_bytes = max((len(t.encode("utf-8", "replace")) for t in self.tokenizer.tokens), default=1)
        self.markers = marker_ids(self.tokenizer)
        self.runtime = ModelRuntime(loaded)
        # under mlx.launch every rank runs the same generation in lockstep: one at a time
        self.worker.max_running = 1 if self.runtime.lockstep is not None else self.limits.parallel
        return info

    def _finish(self) -> None:
        """The worker stops: under mlx.launch the other ranks leave their follower loop."""
        if self.runtime is not None:
            self.runtime.shutdown()

    # queueing -------------------------------------------------------------
    def retry_after(self) -> int:
        """Seconds until a place in the full queue frees: what the running job has left, by the
        median of recent jobs (a place frees when it ends and the next one starts)."""
        per_job = statistics.median(self._durations) if self._durations else 1.0
        left = per_job - self.worker.running_seconds if self.worker.busy else 0.0
        return max(1, math.ceil(left if left > 0 else per_job / 2))

    def _shutdown_error(self) -> APIError:
        return APIError(503, "the server is shutting down; retry on another server or later", type="server_error",
                        code="server_shutdown")

    def submit(self, job: Job) -> None:
        """Queue ``job``; a full queue is a 503 with a Retry-After estimate."""
        if self.stopping:
            raise self._shutdown_error()
        job.submitted_at = time.perf_counter()
        try:
            self.host.submit(lambda t: self._run_job(job, t), skipped=lambda t: self._skip(job), cancel=job.cancel)
        except WorkerBusy as e:
            self.totals["refused"] += 1
            wait = self.retry_after()
            raise APIError(503, f"server busy: {e.waiting} requests are waiting (--queue-size); retry in {wait} s",
                           type="server_error", code="server_busy", headers={"Retry-After": str(wait)}) from None
        except WorkerStopped:
            raise APIError(503, "the model worker is not running; restart the server", type="server_error",
                           code="engine_down") from None
        job.submitted = True

    def connection_refused(self) -> None:
        """The connection guard refused a connection (--max-connections): counted for /metrics."""
        self.totals["connections_refused"] += 1

    def rejected(self) -> None:
        """A request was answered with a 4xx (the client's error): counted for /metrics."""
        self.totals["rejected"] += 1

    def metrics(self) -> list[tuple[str, str, float, str]]:
        """(name, Prometheus type, value, help) of the counters and gauges (:data:`.metrics.METRICS`)."""
        return [(name, kind, read(self), help_text) for name, kind, read, help_text in METRICS]

    def metrics_text(self) -> str:
        """/metrics in Prometheus' text format: :meth:`metrics` and the latency histograms."""
        return prometheus_text(self.metrics(), self.latency)

    # generation (worker thread) ------------------------------------------
    def _skip(self, job: Job) -> None:
        """The client left while its request waited: it never runs (a cancelled request all the same)."""
        self.totals["cancelled"] += 1
        job.stats.update(finish="cancelled", steps=0)
        job.emit(*(("error", self._shutdown_error()) if self.stopping else ("done", None)))
        job.release()

    def _run_job(self, job: Job, ticket: Ticket) -> bool:
        """One turn of ``job``: its generation up to the next block boundary. Returns whether it
        has more (the worker then gives it another turn after the others')."""
        now = job.turn_started = time.perf_counter()
        if job.work is None:
            job.started = now
            self.latency["queue"].observe(now - job.submitted_at)
            job.work = self._work(job)
        more = False
        try:
            next(job.work)
            more = True
        except StopIteration:
            pass
        except APIError as e:
            job.emit("error", e)
        except DGemmaError as e:
            job.emit("error", APIError(400, str(e), param=getattr(e, "param", None)))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the worker
            log.exception("engine error")
            self._session = None
            job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
        finally:
            job.model_s += time.perf_counter() - now
            if not more:
                seconds = time.perf_counter() - job.started
                job.stats["engine_s"] = round(seconds, 4)
                if job.model_s < seconds - 1e-3:  # it shared the model: how much of it was its own
                    job.stats["model_s"] = round(job.model_s, 4)
                self.served += 1
                self._durations.append(seconds)
                job.release()
        return more

    def _cancelled(self, job: Job) -> Any:
        """The cancel check the core polls: the client left, or the request has had the model's
        time it may (--max-request-seconds: its own turns, not the others')."""
        limit = self.limits.max_request_seconds
        if limit is None:
            return job.cancel.is_set

        def check() -> bool:
            if job.cancel.is_set():
                return True
            if job.model_s + time.perf_counter() - job.turn_started > limit:
                job.stats["timeout"] = True
                return True
            return False

        return check

    def _work(self, job: Job) -> Iterator[None]:
        """``job``'s whole generation, yielding at each block boundary (a turn)."""
        rt = self.runtime
        if job.kind == "completion":
            events = rt.generate(job.prompt, request=job.request, chat=False, cancel=self._cancelled(job))
            yield from self._consume(job, events, lambda: 0)
            return
        if job.forced is not None:
            yield from self._forced(job)
            return
        if not plain_chat(job.prompt, job.tools) or job.continued or self._session_busy:
            # tools, tool calls or results, a continued answer, or another request holds the
            # session: a fresh render (the session continues user turns only, one at a time)
            yield from self._consume(job, self._fresh(job), lambda: 0)
            return
        earlier, user = job.prompt[:-1], job.prompt[-1]["content"]
        s, self._session = self._session, None  # reusable again only if this turn ends cleanly
        self._session_busy = True
        try:
            if s is None or s is not rt.session or s.enable_thinking != job.enable_thinking:
                rt.new_chat(enable_thinking=job.enable_thinking)  # on every rank, under mlx.launch
            s = rt.session
            # The session reuses its cache only where its tokens are a prefix of this conversation's
            # fresh render (another client's conversation, an edited answer: encoded afresh), so the
            # answer never depends on what came before this request.
            result, clean, _ = yield from self._consume(
                job, rt.chat(user, request=job.request, cancel=self._cancelled(job), messages=earlier),
                lambda: s.cached_tokens)
            if clean and result is not None:
                self._session = s
        finally:
            self._session_busy = False

    def _fresh(self, job: Job, request: GenerationRequest | None = None) -> Iterator[Any]:
        """The core's events for ``job``'s conversation rendered afresh (under ``request``: the
        job's unless another is given)."""
        text = self.prompt_text(job.prompt, job.enable_thinking, job.tools, job.continued)
        return self.runtime.generate(self.tokenizer.encode(text), request=request or job.request, chat=False,
                                     cancel=self._cancelled(job))

    def _forced(self, job: Job) -> Iterator[None]:
        """A forced tool call (:mod:`.toolcalls`): the call's opening fixed on the canvas; checked;
        if it does not hold, one repair pass with the call's whole frame fixed."""
        from mlx_dgemma.canvas import CanvasTemplate

        forced = job.forced
        assert forced is not None
        tok = self.tokenizer
        opening = CanvasTemplate.from_pieces(tok, forced.opening())

        def prompt_tokens() -> int:
            return self._prompt_tokens(job.prompt, job.enable_thinking, job.tools, job.continued)

        first = (self.room_for(job.request, opening.end, job.max_tokens, prompt_tokens)
                 or job.request).with_options(template=opening)
        # "required": the model's log-probabilities at the name's positions choose a declared name
        # if it writes none (not under mlx.launch, where each rank holds part of the vocabulary)
        if not forced.named and job.logprobs is None and self.runtime.lockstep is None:
            first = first.with_options(logprobs=toolcalls.NAME_TOP_LOGPROBS)
        # a call the model has not closed within a few blocks will not close: the repair pass takes over
        first = first.with_params(max_new_tokens=min(self.max_new_tokens(first),
                                                     max(toolcalls.FIRST_PASS_TOKENS, self.blocks_tokens(opening.end))))
        tops: list[list[tuple[int, float]]] = []
        # the pass ends with its first call (or the first block that closes a malformed one)
        result, _, answer = yield from self._consume(job, self._fresh(job, first), lambda: 0, final=False, tops=tops,
                                                     enough=lambda a: bool(a.tool_calls) or TOOL_CALL_CLOSE in a.content)
        if result is None:
            return
        call = answer.tool_calls[0] if answer.tool_calls else None
        problem = toolcalls.check(call, forced)
        if problem is None:
            result = replace(result, content="", tool_calls=(call,), finish_reason="tool_calls")
            self._deliver(job, result)
            return
        if forced.named:
            name = forced.names()[0]
        elif call is not None and forced.tool(call.name) is not None:
            name = call.name
        else:
            name = toolcalls.choose_name(forced, tops, len(tok.encode(forced.opening()[0])), tok.encode)
        frame = toolcalls.Frame.of(forced.tool(name))  # type: ignore[arg-type]
        template = CanvasTemplate.from_pieces(tok, frame.pieces)
        room = self.room_for(job.request, template.end, job.max_tokens, prompt_tokens)
        if room is None:
            log.info("%s: tool call %s (%s); no room for a repair pass: returned as it is", job.stats.get("id"),
                     name, problem)
            self._deliver(job, result)
            return
        self.totals["tool_repairs"] += 1
        job.stats["repair"] = True
        log.info("%s: tool call %s: %s; repairing its arguments", job.stats.get("id"), name, problem)
        # the answer guards judge free text: here the frame is given and the holes are read by type,
        # so a block they would re-roll or drop (its holes still uncertain) is the repair's answer
        repaired, _, answer = yield from self._consume(
            job, self._fresh(job, room.with_options(template=template).with_params(**toolcalls.GUARDS_OFF)), lambda: 0,
            final=False)
        if repaired is None:
            return
        if not answer.eos:  # cut short (max_tokens, the deadline): what the first pass gave
            self._deliver(job, result)
            return
        fixed = ToolCall(name, json.dumps(frame.arguments(answer.tokens, tok), ensure_ascii=False))
        still = toolcalls.check(fixed, forced)
        if still is not None:
            log.warning("%s: tool call %s after its repair pass: %s; returned as it is", job.stats.get("id"),
                        name, still)
        self._deliver(job, replace(repaired, content="", reasoning="", tool_calls=(fixed,),
                                   finish_reason="tool_calls"))

    def _deliver(self, job: Job, r: Result) -> None:
        """``r`` is the answer: counted, logged, and sent."""
        self.totals["prompt_tokens"] += r.usage["prompt_tokens"]
        self.totals["cached_tokens"] += r.usage["prompt_tokens_details"]["cached_tokens"]
        self.totals["completion_tokens"] += r.usage["completion_tokens"]
        job.stats.update(prompt=r.usage["prompt_tokens"], cached=r.usage["prompt_tokens_details"]["cached_tokens"],
                         completion=r.usage["completion_tokens"],
                         reasoning=r.usage["completion_tokens_details"]["reasoning_tokens"], finish=r.finish_reason)
        job.stats["answer_s"] = round(time.perf_counter() - job.started, 4)
        self.latency["total"].observe(time.perf_counter() - job.submitted_at)
        job.answered = True
        job.emit("done", r)

    def _consume(self, job: Job, events: Iterator[Any], cached_tokens: Callable[[], int], final: bool = True,
                 tops: list[list[tuple[int, float]]] | None = None,
                 enough: Callable[[Answer], bool] | None = None) -> Iterator[None]:
        """Drive one generation, yielding at each block boundary (and prefill chunk), emitting
        block texts (and steps if asked) and the result as soon as the last block is committed:
        the client does not wait for the cache commit that follows it (that is for the next
        turn). Returns (the result, None if cancelled; whether the generator ran to its end;
        the Answer). ``final=False``: one pass of several (a forced call's), nothing emitted;
        ``tops`` collects each position's most likely (id, log-probability) pairs (with
        logprobs); ``enough(answer)`` ends the pass after a block."""
        from mlx_dgemma.events import BlockEvent, PrefillEvent, PrefillProgressEvent, StepEvent
        from mlx_dgemma.sampler import finalize_block

        core = job.request.resolve(self.generation_config)  # as the core reads it
        answer = Answer(self.tokenizer, core.eos_token_id, job.max_tokens, job.stop, self.markers,
                        tools=bool(job.tools), raw=job.kind != "chat" or job.continued, pad_id=core.pad_token_id)
        result: Result | None = None
        prefill = 0
        clean = True
        clock = Timings(self.canvas)
        entries: list[dict[str, Any]] = []  # with logprobs: one per generated token, in order
        last_step: Any = None  # the block in progress' latest step (a deadline commits its draft)
        blocks = 0
        first_block = "first_block_s" not in job.stats

        def n_blocks() -> int:
            return self.blocks_tokens(self.max_new_tokens(job.request)) // self.canvas

        def logprobs() -> tuple[dict[str, Any], ...] | None:
            """The counted tokens' entries (as many as completion_tokens: a stop cut, max_tokens
            and the padding after EOS leave out the same tokens)."""
            if job.logprobs is None:
                return None
            kept = answer.tokens[:answer.positions]
            return tuple(e for e, t in zip(entries, kept) if t != core.pad_token_id)

        def finish() -> Result:
            cached = cached_tokens()  # known once the generation has started
            if cached and final:
                self.reused_prefixes += 1  # before the answer goes out: /health agrees with it
            usage = {"prompt_tokens": cached + prefill, "completion_tokens": answer.completion_tokens,
                     "total_tokens": cached + prefill + answer.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached},
                     "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens}}
            r = Result(answer.content, answer.reasoning, answer.finish_reason, usage, tuple(answer.tool_calls),
                       logprobs(), clock.timings(cached, prefill, answer.completion_tokens), answer.finish_detail)
            if final:
                self._deliver(job, r)
            return r

        def add(tokens: tuple[int, ...], text: str, thinking: str, lps: Any = None, end: str | None = None) -> None:
            answer.add(tokens, text, thinking, end)
            if lps is not None and lps[0] is not None:
                lp, ids, top = (a.tolist() for a in lps)
                if job.logprobs is not None:
                    entries.extend(logprob_entry(self.tokenizer, t, v, i, tl)
                                   for t, v, i, tl in zip(tokens, lp, ids, top))
                if tops is not None:
                    tops.extend(list(zip(i, tl)) for i, tl in zip(ids, top))

        for ev in events:
            if isinstance(ev, StepEvent):
                clock.add(ev)
                last_step = ev
                if job.stream_steps and final:
                    job.emit("step", step_payload(self.tokenizer, ev))
            elif isinstance(ev, BlockEvent):
                last_step = None
                blocks += 1
                clock.add(ev)
                add(ev.tokens, ev.text, ev.thinking, (ev.logprobs, ev.top_ids, ev.top_logprobs), ev.end)
                if first_block and blocks == 1:
                    job.stats["first_block_s"] = round(time.perf_counter() - job.submitted_at, 4)
                    self.latency["first_block"].observe(time.perf_counter() - job.submitted_at)
                if job.stream_steps and final:
                    job.emit("step", block_payload(ev))
                if final:  # a snapshot: the worker goes on mutating answer
                    job.emit("text", (*answer.streamable(), tuple(answer.tool_calls), logprobs()))
                last = ev.finished or ev.block >= n_blocks()  # blocks count from 1
                if (answer.stop_hit or answer.eos or enough is not None and enough(answer)) and not last:
                    # a stop string, a call's end, padding, or what the pass was for
                    clean = False  # no need for more blocks
                    result = finish()
                    break
                if last and result is None:
                    result = finish()
                if not last:
                    yield  # the block boundary: the other requests' turn
            elif isinstance(ev, PrefillEvent):
                prefill = ev.tokens
                clock.add(ev)
                job.stats.update(prefill=ev.tokens, prefill_s=round(ev.seconds, 4))
            elif isinstance(ev, PrefillProgressEvent):
                yield  # a long prompt's chunks are turns too
        if not clean:
            getattr(events, "close", lambda: None)()  # ends the core's generator at its current yield
        # the log line and /metrics read the same clock as the answer's timings (the core's DoneEvent
        # never comes when a stop string ends the generator early)
        self.totals["steps"] += clock.steps
        job.stats["steps"] = job.stats.get("steps", 0) + clock.steps
        if clock.steps:
            job.stats.update(s_per_step=round(clock.seconds_per_step, 4),
                             tok_per_fwd=round(answer.completion_tokens / clock.steps, 2))
        if result is None and job.stats.get("timeout") and not job.cancel.is_set():
            # --max-request-seconds: what is committed, and the block in progress as its latest
            # draft up to its first EOS (a draft's EOS is not an ending the model committed to),
            # finish_reason "length"
            if last_step is not None:
                block, drafted_eos = finalize_block([int(t) for t in last_step.draft], core.eos_token_id,
                                                    core.pad_token_id)
                if drafted_eos:
                    block = block[:next(i for i, t in enumerate(block) if t in core.eos_token_id)]
                parsed = parse_answer(self.tokenizer.decode(answer.tokens + block))
                answer.add(tuple(block), parsed.answer, parsed.thinking)
            result = finish()
            clean = False
        if result is None:  # cancelled (the client left, or the server stops) before the last block
            self.totals["cancelled"] += 1
            job.stats.update(finish="cancelled")
            job.emit(*(("error", self._shutdown_error()) if self.stopping else ("done", None)))
            return None, False, answer
        return result, clean, answer
