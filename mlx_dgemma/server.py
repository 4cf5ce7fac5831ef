"""``mlx-dgemma serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /health``. One worker thread owns the model and every MLX call; requests wait in a
bounded FIFO queue (full: 503 + ``Retry-After``). A chat request whose messages extend the
previous conversation continues that :class:`~mlx_dgemma.ChatSession`, so only the new turn
is prefilled (``usage.prompt_tokens_details.cached_tokens`` says how much was reused).

The thought channel goes to ``reasoning_content``, never into ``content``; earlier assistant
turns are re-rendered without their thoughts. Streams carry one content delta per committed
block and, on request (``"diffusion": {"stream_steps": true}``), one ``diffusion`` event per
denoising step. Errors are OpenAI-style JSON objects (400, 404, 405, 413, 503, 500).
"""


import argparse
import asyncio
import json
import logging
import math
import queue
import socket
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlx_dgemma.chat_template import THOUGHT_CLOSE, THOUGHT_OPEN, parse_answer, render_chat
from mlx_dgemma.errors import DGemmaError, ParameterError

log = logging.getLogger("mlx_dgemma.server")

DEMO_MODEL_ID = "mlx-dgemma-demo"
MAX_DRAIN_BYTES = 256 << 20  # an oversized body is read and dropped up to this size, then the connection closed
MIN_TEMPERATURE_FACTOR = 0.01  # temperature 0 -> the schedule scaled by this (near-greedy)
SAMPLER_FIELDS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                  "confidence_threshold", "sc_top_k")


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered as an OpenAI-style ``{"error": {...}}`` object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContextLengthError(APIError):
    """The prompt plus the requested blocks do not fit the model's context (413)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(413, message, param=param, code="context_length_exceeded")


# --------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    # strict: "0.5" is not a number and 1.0 not an integer, as the OpenAI API answers;
    # unknown fields are ignored, as OpenAI clients expect (they send extras freely)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class DiffusionOptions(_Body):
    stream_steps: bool = False


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> str:
        """A string, or a list of text parts (``[{"type": "text", "text": ...}]``)."""
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list):
            out = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only {{'type': 'text', 'text': str}} parts are supported")
                out.append(part["text"])
            return "".join(out)
        raise ValueError("expected a string or a list of text parts")


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # accepted for compatibility; the sampler has no top-p
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Any = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # our sampler's settings, as extra top-level fields
    max_denoising_steps: int | None = Field(None, ge=1, le=10_000)
    t_min: float | None = Field(None, gt=0)
    t_max: float | None = Field(None, gt=0)
    entropy_bound: float | None = Field(None, gt=0)
    stability_threshold: int | None = Field(None, ge=0, le=10_000)
    confidence_threshold: float | None = Field(None, gt=0)
    sc_top_k: int | None = Field(None, ge=1)
    diffusion: DiffusionOptions | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or \
                not all(isinstance(s, str) and s for s in stops):
            raise ValueError("expected a non-empty string or a list of 1 to 4 non-empty strings")
        return tuple(stops)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def thinking(self) -> bool:
        if self.enable_thinking is not None:
            return self.enable_thinking
        v = (self.chat_template_kwargs or {}).get("enable_thinking", False)
        if not isinstance(v, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking: expected true or false",
                           param="chat_template_kwargs.enable_thinking")
        return v


class CompletionRequest(_Sampling):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        """A string, a list of one string, or a list of token ids."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("empty; give some text")
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("expected a non-empty string, a list of one string, or a list of token ids")


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_body(cls: type[_Body], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}", param=param) from None


# --------------------------------------------------------------------------- answers


@dataclass
class Answer:
    """The answer as the client sees it, rebuilt after every committed block.

    ``max_tokens`` cuts the token list exactly (blocks are whole canvases, the API's limit
    is in tokens); ``stop`` cuts the visible text; the thought channel never reaches content.
    """

    tokenizer: Any
    eos_ids: tuple[int, ...]
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    eos: bool = False
    stop_hit: bool = False
    cut: bool = False  # max_tokens ended the answer before an EOS

    def add(self, block_tokens: tuple[int, ...], text: str, thinking: str) -> None:
        """Add one committed block (its tokens and the core's parsed text so far)."""
        self.tokens += block_tokens
        gen = self.tokens
        if self.max_tokens is not None and len(gen) > self.max_tokens:
            gen = gen[: self.max_tokens]
            parsed = parse_answer(self.tokenizer.decode(gen))
            text, thinking = parsed.answer, parsed.thinking
        eos_at = next((i for i, t in enumerate(gen) if t in self.eos_ids), None)
        self.eos = eos_at is not None
        self.cut = not self.eos and len(gen) < len(self.tokens)
        gen = gen[: eos_at + 1] if eos_at is not None else gen
        self.completion_tokens = len(gen)
        self.reasoning_tokens = _thought_tokens(self.tokenizer, gen)
        hits = [i for i in (text.find(s) for s in self.stop) if i != -1]
        self.stop_hit = bool(hits)
        self.content = text[: min(hits)] if hits else text
        self.reasoning = thinking

    @property
    def finished(self) -> bool:
        return self.eos or self.stop_hit or self.cut

    @property
    def finish_reason(self) -> str:
        return "stop" if self.eos or self.stop_hit else "length"

    def streamable(self) -> tuple[str, str]:
        """(content, reasoning) safe to send before the answer is final: a trailing U+FFFD may be
        half a character the next block completes, a trailing prefix of a stop string may
        become the stop string."""
        content, reasoning = self.content.rstrip("\ufffd"), self.reasoning.rstrip("\ufffd")
        if not self.stop_hit:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(content)), 0, -1):
                    if content.endswith(s[:k]):
                        content = content[:-k]
                        break
        return content, reasoning


def _thought_tokens(tokenizer: Any, ids: list[int]) -> int:
    """Tokens inside the thought channel (markers included)."""
    open_id, close_id = _marker_id(tokenizer, THOUGHT_OPEN), _marker_id(tokenizer, THOUGHT_CLOSE)
    if open_id is None or open_id not in ids:
        return 0
    start = ids.index(open_id)
    end = ids.index(close_id, start) + 1 if close_id is not None and close_id in ids[start:] else len(ids)
    return end - start


def _marker_id(tokenizer: Any, text: str) -> int | None:
    cache = tokenizer.__dict__.setdefault("_server_marker_ids", {})
    if text not in cache:
        ids = tokenizer.encode(text)
        cache[text] = ids[0] if len(ids) == 1 else None
    return cache[text]


class Deltas:
    """Turns successive snapshots of a growing text into append-only deltas."""

    def __init__(self) -> None:
        self.sent = ""

    def __call__(self, text: str) -> str:
        # Normally ``text`` extends what was sent. Rarely it differs behind it (a decode that
        # re-spells earlier bytes): a stream cannot retract, so only what goes beyond is sent.
        delta = text[len(self.sent):]
        if len(text) >= len(self.sent):
            self.sent = text
        return delta


# --------------------------------------------------------------------------- engine


@dataclass
class Job:
    """One request, as the worker sees it."""

    kind: Literal["chat", "completion"]
    prompt: Any  # normalized messages (chat) or token ids (completion)
    params: dict[str, Any]
    max_tokens: int | None
    stop: tuple[str, ...]
    enable_thinking: bool
    stream_steps: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: dict[str, Any] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # the worker is done with it
    answered: bool = False  # the result was emitted (the worker may still be committing the cache)
    started: float = 0.0  # perf_counter when the worker took it

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


@dataclass(frozen=True)
class Result:
    content: str
    reasoning: str
    finish_reason: str
    usage: dict[str, Any]


def load_model(model: str | None, demo: bool, dtype: str | None, precision: str) -> tuple[Any, Any]:
    """The one place the server loads a model: the core's ``open_model`` (``--model`` or
    ``--demo``, ``--precision`` and ``--dtype``), with a loading bar on stderr."""
    from mlx_dgemma.loader import open_model
    from mlx_dgemma.progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name))


class Engine:
    """One worker thread owns the model and MLX; jobs run in arrival order.

    ``model`` and ``tokenizer`` are read by request handlers only for pure-Python work
    (chat template, tokenizer, sizes); every MLX call happens on the worker.
    """

    def __init__(self, model_path: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto", queue_size: int = 16, model_id: str | None = None):
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.dtype_name, self.precision_name = dtype, precision
        self.precision = ""  # the label of what was loaded, e.g. "fast (bfloat16)"
        self.memory_bytes = 0  # memory in use after the last load or job (read by the worker: MLX stays there)
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_id = model_id or (DEMO_MODEL_ID if demo else _model_id(model_path))
        self.created = int(time.time())
        self.busy = False
        self.served = 0
        self.reused_prefixes = 0
        self._session: Any = None  # the last conversation's ChatSession, if reusable
        self._current: Job | None = None
        self._avg_seconds = 1.0
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(model_path, demo), name="mlx-dgemma-engine",
                                        daemon=True)

    # lifecycle ------------------------------------------------------------
    def start(self) -> "Engine":
        """Start the worker and wait until the model is loaded (load errors are raised here)."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self

    def stop(self) -> None:
        """Cancel the running job at its next step, let the worker exit, wait (bounded)."""
        current = self._current
        if current is not None:
            current.cancel.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._load_error is None

    def _main(self, model_path: str | None, demo: bool) -> None:
        try:
            from mlx_dgemma.generation import precision_label
            from mlx_dgemma.memory import memory_bytes

            self.model, self.tokenizer = load_model(model_path, demo, self.dtype_name, self.precision_name)
            self.precision = precision_label(self.model)
            self.generation_config = getattr(self.model, "generation_config", None) or {}
            self.canvas = int(self.model.args.canvas_length)
            self.context = int(self.model.args.max_position_embeddings)
            self.memory_bytes = memory_bytes()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that called start()
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancel.is_set():  # the client left while queued
                job.stats.update(finish="cancelled", steps=0)
                job.emit("done", None)
                job.release()
                continue
            self.busy, self._current = True, job
            t0 = job.started = time.perf_counter()
            try:
                self._run(job)  # emits the result itself
            except APIError as e:
                job.emit("error", e)
            except DGemmaError as e:
                job.emit("error", APIError(400, str(e)))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the worker
                log.exception("engine error")
                self._session = None
                job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
            finally:
                job.stats["engine_s"] = round(time.perf_counter() - t0, 4)
                self.memory_bytes = memory_bytes()
                job.release()
                self.busy, self._current = False, None
                self.served += 1
                self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * (time.perf_counter() - t0)

    def submit(self, job: Job) -> None:
        """Queue ``job``; a full queue is a 503 with a Retry-After estimate."""
        if not self.alive:
            raise APIError(503, "the model worker is not running; restart the server", type="server_error",
                           code="engine_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            wait = max(1, math.ceil(self._avg_seconds * (self.queue.qsize() + 1)))
            raise APIError(503, f"server busy: {self.queue.qsize()} requests are waiting; retry in {wait} s",
                           type="server_error", code="server_busy", headers={"Retry-After": str(wait)}) from None

    # request preparation (handler threads; no MLX) ------------------------
    def sampler_overrides(self, req: _Sampling, max_tokens: int | None) -> dict[str, Any]:
        """Request fields -> stream_generate parameters, validated as the core validates them.

        ``temperature`` scales the whole linear schedule (t_max -> t_min): 1 keeps the
        model's schedule, 0.5 halves both ends, 0 is taken as 0.01 (near-greedy: almost every
        position is accepted at the first step)."""
        from mlx_dgemma.sampler import SamplerParams

        over = {k: getattr(req, k) for k in SAMPLER_FIELDS if getattr(req, k) is not None}
        if max_tokens is not None:
            if max_tokens > self.context:  # beyond the context whatever the prompt: 413, not a range error
                raise ContextLengthError(f"max_tokens: {max_tokens} is beyond the model's context of "
                                         f"{self.context} tokens; lower max_tokens", "max_tokens")
            over["max_new_tokens"] = max_tokens
        if req.seed is not None:
            over["seed"] = req.seed
        if req.temperature is not None and req.temperature != 1:
            base = SamplerParams.from_config(self.generation_config, **over)
            f = max(req.temperature, MIN_TEMPERATURE_FACTOR)
            # the core accepts temperatures from 0.001 (validate.py): near-greedy, not below it
            over["t_min"] = max(base.t_min * f, 0.001)
            over["t_max"] = max(base.t_max * f, 2 * over["t_min"])
        try:
            SamplerParams.from_config(self.generation_config, **over)
        except ParameterError as e:
            raise APIError(400, str(e), param=e.param) from None
        return over

    def blocks_tokens(self, max_new_tokens: int) -> int:
        return math.ceil(max_new_tokens / self.canvas) * self.canvas

    def check_context(self, prompt_tokens: int, max_new_tokens: int, param: str = "messages") -> None:
        need = prompt_tokens + self.blocks_tokens(max_new_tokens)
        if need > self.context:
            raise ContextLengthError(
                f"{param}: the prompt is {prompt_tokens} tokens and the answer needs "
                f"{self.blocks_tokens(max_new_tokens)} (whole {self.canvas}-token blocks): {need} exceed the "
                f"model's context of {self.context}; shorten the {param} or lower max_tokens", param)

    def max_new_tokens(self, params: dict[str, Any]) -> int:
        return int(params.get("max_new_tokens") or self.generation_config.get("max_new_tokens") or 256)

    def prepare_chat(self, messages: list[dict[str, str]], enable_thinking: bool, params: dict[str, Any]) -> int:
        """Render the whole conversation as a fresh prompt: template errors are 400, a prompt
        beyond the context 413. Returns its token count."""
        try:
            text = render_chat(messages, self.tokenizer.chat_template, enable_thinking=enable_thinking)
        except ParameterError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template's own error on odd input
            raise APIError(400, f"messages: the chat template cannot render them ({e})", param="messages") from None
        n = len(self.tokenizer.encode(text))
        self.check_context(n, self.max_new_tokens(params))
        return n

    def prepare_completion(self, prompt: str | list[int], params: dict[str, Any]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            V = int(self.model.args.vocab_size)
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < V), None)
            if bad is not None:
                raise APIError(400, f"prompt[{bad}]: token id {prompt[bad]} is outside [0, {V})",
                               param=f"prompt[{bad}]")
            ids = list(prompt)
        self.check_context(len(ids), self.max_new_tokens(params), "prompt")
        return ids

    # generation (worker thread) ------------------------------------------
    def _run(self, job: Job) -> Result | None:
        from mlx_dgemma import stream_generate

        if job.kind == "completion":
            events = stream_generate(self.model, self.tokenizer, job.prompt, generation_config=self.generation_config,
                                     chat=False, cancel=job.cancel.is_set, **job.params)
            result, _ = self._consume(job, events, cached=0)
            return result
        return self._run_chat(job)

    def _run_chat(self, job: Job) -> Result | None:
        from mlx_dgemma import ChatSession

        earlier, user = job.prompt[:-1], job.prompt[-1]["content"]
        s, self._session = self._session, None  # reusable again only if this turn ends cleanly
        cached = len(s.history) if s is not None else 0
        reuse = (s is not None and s.enable_thinking == job.enable_thinking and s.messages == earlier
                 # the cache holds earlier answers with their padding: fall back to a fresh,
                 # shorter prompt where the continuation would not fit (16 = turn markup)
                 and cached + len(self.tokenizer.encode(user)) + 16
                 + self.blocks_tokens(self.max_new_tokens(job.params)) <= self.context)
        if not reuse:
            s = ChatSession(self.model, self.tokenizer, self.generation_config, enable_thinking=job.enable_thinking)
            s.messages = [dict(m) for m in earlier]  # rendered with the new turn on the first stream()
            cached = 0
        else:
            self.reused_prefixes += 1
        result, clean = self._consume(job, s.stream(user, cancel=job.cancel.is_set, **job.params), cached)
        # Reuse needs the cache to hold what the next request will send back: the answer as the
        # client saw it (not cut by stop or max_tokens) and without thoughts (the template drops
        # earlier thoughts; the cache would keep them).
        if clean and result is not None and not result.reasoning and s.messages[-1]["content"] == result.content:
            self._session = s
        return result

    def _consume(self, job: Job, events: Iterator[Any], cached: int) -> tuple[Result | None, bool]:
        """Drive one generation, emitting block texts (and steps if asked) and the result as
        soon as the last block is committed: the client does not wait for the cache commit
        that follows it (that is for the next turn). Returns the result (None if cancelled)
        and whether the generator ran to its end."""
        from mlx_dgemma.generation import BlockEvent, DoneEvent, PrefillEvent, StepEvent
        from mlx_dgemma.sampler import SamplerParams

        eos = SamplerParams.from_config(self.generation_config, **job.params).eos_token_id  # as the core reads it
        answer = Answer(self.tokenizer, eos, job.max_tokens, job.stop)
        n_blocks = self.blocks_tokens(self.max_new_tokens(job.params)) // self.canvas
        done: Any = None
        result: Result | None = None
        prefill = 0
        clean = True

        def finish() -> Result:
            usage = {"prompt_tokens": cached + prefill, "completion_tokens": answer.completion_tokens,
                     "total_tokens": cached + prefill + answer.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached},
                     "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens}}
            job.stats.update(prompt=cached + prefill, cached=cached, completion=answer.completion_tokens,
                             reasoning=answer.reasoning_tokens, finish=answer.finish_reason)
            r = Result(answer.content, answer.reasoning, answer.finish_reason, usage)
            job.stats["answer_s"] = round(time.perf_counter() - job.started, 4)
            job.answered = True
            job.emit("done", r)
            return r

        for ev in events:
            if isinstance(ev, StepEvent):
                if job.stream_steps:
                    job.emit("step", self._step_payload(ev))
            elif isinstance(ev, BlockEvent):
                answer.add(ev.tokens, ev.text, ev.thinking)
                if job.stream_steps:
                    job.emit("step", {"type": "block", "block": ev.block, "steps": ev.steps, "finished": ev.finished})
                job.emit("text", answer.streamable())  # a snapshot: the worker goes on mutating answer
                last = ev.finished or ev.block + 1 >= n_blocks
                if answer.stop_hit and not last:
                    clean = False  # a stop string: no need for more blocks
                    result = finish()
                    break
                if last and result is None:
                    result = finish()
            elif isinstance(ev, PrefillEvent):
                prefill = ev.tokens
                job.stats.update(prefill=ev.tokens, prefill_s=round(ev.seconds, 4))
            elif isinstance(ev, DoneEvent):
                done = ev
        if not clean:
            getattr(events, "close", lambda: None)()  # ends the core's generator at its current yield
        if done is not None:
            job.stats.update(steps=done.steps, s_per_step=round(done.seconds_per_step, 4),
                             tok_per_fwd=round(done.tokens_per_forward, 2))
        if result is None:  # cancelled (the client left) before the last block
            job.stats.update(finish="cancelled")
            job.emit("done", None)
            return None, False
        return result, clean

    def _step_payload(self, ev: Any) -> dict[str, Any]:
        tok = self.tokenizer
        draft = ev.draft.tolist()
        return {"type": "step", "block": ev.block, "step": ev.step, "max_steps": ev.max_steps,
                "draft": tok.decode(draft), "tokens": [tok.piece(t) for t in draft],
                "accepted": ev.accepted.astype(int).tolist(), "mean_entropy": round(float(ev.mean_entropy), 6),
                "temperature": round(float(ev.temperature), 6)}


def _model_id(path: str | None) -> str:
    from pathlib import Path

    if not path:
        return "mlx-dgemma"
    p = Path(path).expanduser()
    return p.stem if p.suffix == ".gguf" else p.name


def normalize_messages(messages: list[Message]) -> list[dict[str, str]]:
    """OpenAI messages -> the template's {'role', 'content'}: 'developer' is 'system', earlier
    assistant turns lose their thought channel (and any reasoning_content the client sent)."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if role == "assistant" and (THOUGHT_OPEN in content or "<turn|>" in content):
            content = parse_answer(content).answer
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------- HTTP


def _chunk(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _read_json(request: Any, limit: int) -> Any:
    declared = request.headers.get("content-length")
    too_big = bool(declared and declared.isdigit() and int(declared) > limit)
    body = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        too_big = too_big or seen > limit
        if too_big:
            # read (and drop) the rest so that the client can finish sending and read the answer;
            # past MAX_DRAIN_BYTES the connection is simply closed
            if seen > MAX_DRAIN_BYTES:
                break
            continue
        body += chunk
    if too_big:
        raise APIError(413, f"body: {max(seen, int(declared or 0))} bytes is over the limit of {limit}; "
                       "send a smaller request (or start the server with a larger --max-body-mb)",
                       code="body_too_large")
    if not body:
        raise APIError(400, "body: empty; send a JSON object")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"body: not valid JSON ({e}); send a JSON object") from None


async def _watch_disconnect(request: Any, job: Job) -> None:
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


class _Formatter:
    """OpenAI response objects for one request (chat or text completion)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _base(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + ".chunk" if chunk and self.kind == "chat" else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, r: Result) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": r.content}
            if r.reasoning:
                message["reasoning_content"] = r.reasoning
            choice = {"index": 0, "message": message, "finish_reason": r.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": r.content, "finish_reason": r.finish_reason, "logprobs": None}
        return {**self._base(False), "choices": [choice], "usage": r.usage}

    def delta(self, content: str = "", reasoning: str = "", finish: str | None = None,
              role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            d: dict[str, Any] = {"role": "assistant"} if role else {}
            if content or role:
                d["content"] = content
            if reasoning:
                d["reasoning_content"] = reasoning
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {**self._base(True), "choices": [choice]}

    def extra(self, **fields: Any) -> dict[str, Any]:
        return {**self._base(True), "choices": [], **fields}


def create_app(engine: Engine, *, max_body_bytes: int = 16 << 20) -> Any:
    """The FastAPI application around a started :class:`Engine`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    app = FastAPI(title="mlx-dgemma", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        request.scope.setdefault("mlx_dgemma.log", {})["error"] = e.code or e.param or e.type
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            return error(APIError(404, f"{request.method} {request.url.path}: no such route; see /v1/models, "
                                  "/v1/chat/completions, /v1/completions, /health", code="unknown_url"))
        if e.status_code == 405:
            return error(APIError(405, f"{request.method} {request.url.path}: method not allowed",
                                  code="method_not_allowed"))
        return error(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return error(APIError(500, f"internal error: {type(e).__name__}; see the server log", type="server_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "down", "model": engine.model_id,
                             "precision": engine.precision, "busy": engine.busy,
                             "queued": engine.queue.qsize(), "served": engine.served,
                             "reused_prefixes": engine.reused_prefixes, "memory_bytes": engine.memory_bytes},
                            status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "mlx-dgemma"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.model_id:
            raise _unknown_model(model_id)
        return model_card()

    def _unknown_model(name: str) -> APIError:
        return APIError(404, f"model: {name!r} is not served here; use {engine.model_id!r} (GET /v1/models)",
                        param="model", code="model_not_found")

    async def _submit(request: Request, kind: str, req: _Sampling, prompt: Any, max_tokens: int | None,
                      params: dict[str, Any], thinking: bool) -> Response:
        job = Job(kind, prompt, params, max_tokens, req.stop, thinking,
                  bool(req.diffusion and req.diffusion.stream_steps), asyncio.get_running_loop())
        fmt = _Formatter(kind, engine.model_id)
        job.stats["id"] = fmt.id  # the log line names the response's id
        request.scope.setdefault("mlx_dgemma.log", {})["job"] = job
        engine.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
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

    async def _stream(job: Job, fmt: _Formatter, watcher: asyncio.Task, include_usage: bool) -> AsyncIterator[str]:
        content, reasoning = Deltas(), Deltas()
        try:
            if fmt.kind == "chat":
                yield _chunk(fmt.delta(role=True))
            while True:
                what, payload = await job.queue.get()
                if what == "step":
                    yield _chunk(fmt.extra(diffusion=payload))
                elif what == "text":
                    dc, dr = content(payload[0]), reasoning(payload[1])
                    if dc or dr:
                        yield _chunk(fmt.delta(dc, dr))
                elif what == "done":
                    if payload is None:
                        return
                    dc, dr = content(payload.content), reasoning(payload.reasoning)
                    if dc or dr:
                        yield _chunk(fmt.delta(dc, dr))
                    yield _chunk(fmt.delta(finish=payload.finish_reason))
                    if include_usage:
                        yield _chunk({**fmt.extra(), "usage": payload.usage})
                    yield "data: [DONE]\n\n"
                    return
                elif what == "error":
                    job.stats["error"] = payload.code or payload.type
                    yield _chunk(payload.body())
                    yield "data: [DONE]\n\n"
                    return
                elif what == "gone":
                    return
        finally:
            if not job.answered:  # the stream ended early (client gone): stop at the next step
                job.cancel.set()
            watcher.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatRequest = parse_body(ChatRequest, await _read_json(request, max_body_bytes))
        if req.model is not None and req.model != engine.model_id:
            raise _unknown_model(req.model)
        messages = normalize_messages(req.messages)
        if messages[-1]["role"] != "user":
            raise APIError(400, f"messages[{len(messages) - 1}].role: the last message must be the user's "
                           f"(got {messages[-1]['role']!r})", param=f"messages[{len(messages) - 1}].role")
        if not messages[-1]["content"].strip():
            raise APIError(400, f"messages[{len(messages) - 1}].content: empty; give some text",
                           param=f"messages[{len(messages) - 1}].content")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        thinking = req.thinking()
        params = engine.sampler_overrides(req, max_tokens)
        await run_in_threadpool(engine.prepare_chat, messages, thinking, params)
        return await _submit(request, "chat", req, messages, max_tokens, params, thinking)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_body(CompletionRequest, await _read_json(request, max_body_bytes))
        if req.model is not None and req.model != engine.model_id:
            raise _unknown_model(req.model)
        params = engine.sampler_overrides(req, req.max_tokens)
        ids = await run_in_threadpool(engine.prepare_completion, req.prompt, params)
        return await _submit(request, "completion", req, ids, req.max_tokens, params, False)

    return app


class RequestLog:
    """Outermost ASGI wrapper: one log line per request, and no exception ever reaches the
    server (a client that vanished mid-response is logged, not raised)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status: list[int | None] = [None]
        info: dict[str, Any] = scope.setdefault("mlx_dgemma.log", {})

        async def _send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        except Exception as e:  # noqa: BLE001 - disconnects, or an error already answered as 500
            info.setdefault("error", type(e).__name__)
        finally:
            job: Job | None = info.get("job")
            if job is not None and not job.finished.is_set():
                # the response ended before the worker finished: if before the answer (the client
                # left, or a failure) stop it at the next step; log how far it got
                if not job.answered:
                    job.cancel.set()
                try:
                    await asyncio.wait_for(job.finished.wait(), 60)
                except asyncio.TimeoutError:
                    pass
            fields = [f"{k}={v}" for k, v in (job.stats if job else {}).items() if v is not None]
            if "error" in info:
                fields.append(f"error={info['error']}")
            log.info("%s %s %s %.3fs %s", scope.get("method"), scope.get("path"), status[0] or "-",
                     time.perf_counter() - t0, " ".join(fields))


# --------------------------------------------------------------------------- CLI


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="converted directory or .gguf file")
    p.add_argument("--demo", action="store_true",
                   help="the small built-in demo model (see `mlx-dgemma chat --demo`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    from mlx_dgemma.cli import add_precision_args

    add_precision_args(p)
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait behind the running one before 503 (default 16)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MB (default 16)")
    p.add_argument("--model-id", help="the model name clients send (default: the file or directory name)")


def _listen(host: str, port: int) -> socket.socket:
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


def main(args: argparse.Namespace) -> int:
    """``mlx-dgemma serve``: load the model, listen, serve until interrupted."""
    import uvicorn

    if args.queue_size < 1:
        raise ParameterError(f"--queue-size {args.queue_size}: must be at least 1")
    if not args.max_body_mb > 0:
        raise ParameterError(f"--max-body-mb {args.max_body_mb}: must be > 0")
    from mlx_dgemma.loader import check_model_choice

    check_model_choice(args.model, args.demo)
    sock = _listen(args.host, args.port)  # before loading: a taken port fails fast
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    engine = Engine(args.model, args.demo, args.dtype, args.precision, args.queue_size, args.model_id)
    try:
        engine.start()
    except DGemmaError as e:
        if getattr(args, "debug", False):
            raise
        # exit here, not through the interpreter's shutdown: MLX state created by the worker
        # thread can abort it ("terminate called without an active exception"), see below
        print(f"mlx-dgemma serve: error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)
    app = RequestLog(create_app(engine, max_body_bytes=int(args.max_body_mb * (1 << 20))))
    # keep-alive 30 s: clients that reuse a connection between turns rarely find it closed
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                            timeout_keep_alive=30, lifespan="off")
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"mlx-dgemma serve: {engine.model_id} ({engine.precision}) on http://{shown}:{port}/v1 (Ctrl+C to stop)", file=sys.stderr,
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        print("mlx-dgemma serve: stopped", file=sys.stderr, flush=True)
        logging.shutdown()
        # Nothing is left to write, and C++ static destructors racing the MLX worker thread's
        # state at interpreter exit aborted 3 of 11 Ctrl+C stops ("terminate called without an
        # active exception", status 134): leave without them.
        sys.stdout.flush()
        os._exit(0)
