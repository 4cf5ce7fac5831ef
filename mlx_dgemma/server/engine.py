"""The server's side of the model: requests checked and shaped for the core (handler threads,
no MLX), and their generation on the core's :class:`~mlx_dgemma.worker.ModelWorker` (the
one thread that owns the model), reported to the request's event loop as it goes.

A chat request whose messages extend the previous conversation continues that
:class:`~mlx_dgemma.ChatSession`, so only the new turn is prefilled.
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mlx_dgemma.chat_template import RENDER_CHARS, THOUGHT_OPEN, parse_answer, render_chat, template_for_tools
from mlx_dgemma.errors import DGemmaError, ParameterError
from mlx_dgemma.worker import ModelWorker, Ticket, WorkerBusy, WorkerStopped

from .errors import APIError, ContextLengthError
from .openai import Answer, Result, marker_ids
from .schemas import MAX_JSON_DEPTH, NOT_FINITE, SAMPLER_FIELDS, Message, Sampling, finite_json, json_depth

if TYPE_CHECKING:
    from mlx_dgemma.runtime import Runtime

log = logging.getLogger("mlx_dgemma.server")

DEMO_MODEL_ID = "mlx-dgemma-demo"
MIN_TEMPERATURE_FACTOR = 0.01  # temperature 0 -> the schedule scaled by this (near-greedy)
GREEDY_SEED = 0  # temperature 0 without a seed: a fixed seed, so that the answer is reproducible


@dataclass
class Job:
    """One request, as the worker sees it; results go to ``queue`` on the request's loop."""

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
    submitted: bool = False  # it reached the worker's queue (a refused job never will)
    answered: bool = False  # the result was emitted (the worker may still be committing the cache)
    started: float = 0.0  # perf_counter when the worker took it
    tools: list[dict[str, Any]] | None = None  # declared to the template; the answer's calls are parsed
    logprobs: int | None = None  # report the answer's log-probabilities, with this many top tokens each

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
               memory_limit: int | None = None) -> Runtime:
    """The one place the server loads a model: the core's ``open_model`` (``--model`` or
    ``--demo``, ``--precision``, ``--dtype`` and ``--memory-limit``: the plan's and every
    request's memory budget), with a loading bar on stderr."""
    from mlx_dgemma.loader import open_model
    from mlx_dgemma.progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name),
                      memory_limit=memory_limit)


def model_id_of(path: str | None) -> str:
    from pathlib import Path

    if not path:
        return "mlx-dgemma"
    p = Path(path).expanduser()
    return p.stem if p.suffix == ".gguf" else p.name


def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages -> the template's {'role', 'content'}: 'developer' is 'system', earlier
    assistant turns lose their thought channel (and any reasoning_content the client sent).

    Tool calls reach the template as transformers passes them (``arguments`` a mapping, not
    JSON text); a tool message carries its function's ``name`` (given, or that of the call
    its ``tool_call_id`` answers), which the template's tool-response format needs."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant messages
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if role == "assistant" and (THOUGHT_OPEN in content or "<turn|>" in content):
            content = parse_answer(content).answer
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and role == "assistant":
            msg["tool_calls"] = []
            for j, c in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
                    too_deep = json_depth(args) > MAX_JSON_DEPTH
                except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python parses
                    raise APIError(400, f"{where}: not valid JSON ({e}); send the arguments as a JSON object",
                                   param=where) from None
                except RecursionError:  # json's decoder recurses: a thousand nested brackets end it
                    too_deep = True
                if too_deep:
                    raise APIError(400, f"{where}: nested more than {MAX_JSON_DEPTH} levels deep; flatten it",
                                   param=where)
                if not finite_json(args):
                    raise APIError(400, f"{where}: {NOT_FINITE}", param=where)
                if not isinstance(args, dict):
                    raise APIError(400, f"{where}: expected a JSON object, got {type(args).__name__}", param=where)
                calls[c.id] = c.function.name
                msg["tool_calls"].append({"id": c.id, "type": "function",
                                          "function": {"name": c.function.name, "arguments": args}})
        if role == "tool":
            name = m.name or calls.get(m.tool_call_id or "")
            if not name:
                where = f"messages[{i}].tool_call_id"
                raise APIError(400, f"{where}: {m.tool_call_id!r} answers no tool call of an earlier assistant "
                               "message; give the id of the call (or the function's name)", param=where)
            msg.update(name=name, tool_call_id=m.tool_call_id)
        out.append(msg)
    return out


def tools_for(tools: list[Any] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the template declares: none with tool_choice "none", only the named one with a
    named function (a name not among ``tools`` is a 400)."""
    if not tools or tool_choice == "none":
        return None
    out = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        out = [t for t in out if t["function"]["name"] == name]
        if not out:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not among the request's tools",
                           param="tool_choice.function.name")
    return out


TOOLS_FIX = "send fewer or shorter tools (or tool_choice naming the one to use)"


def plain_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """A conversation the core's ChatSession continues: no tools, only user/assistant text
    turns ending with the user's."""
    return not tools and messages[-1]["role"] == "user" and \
        all(m["role"] in ("system", "user", "assistant") and not m.get("tool_calls") for m in messages)


class Timings:
    """One answer's clock, from its events: llama.cpp's ``timings`` (prompt_n, prompt_ms,
    predicted_n, predicted_ms and their rates) with the ``diffusion`` part its DiffusionGemma
    server adds (blocks, steps, canvas tokens, ms per step, canvas tokens per second)."""

    def __init__(self, canvas: int):
        self.canvas = canvas
        self.prefill_s = 0.0
        self.t_gen: float | None = None  # when the prompt was encoded (generation starts)
        self.steps = 0
        self.step_seconds = 0.0
        self.steps_per_block: list[int] = []

    def prefilled(self, seconds: float) -> None:
        self.prefill_s, self.t_gen = seconds, time.perf_counter()

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds

    def block(self, steps: int) -> None:
        self.steps_per_block.append(steps)

    def timings(self, cached: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
        """The ``timings`` object: ``prompt_n`` tokens encoded (``cache_n`` taken from the cache),
        ``predicted_n`` answer tokens (usage's completion_tokens) from the prompt's end to now."""
        prompt_ms = 1000 * self.prefill_s
        predicted_ms = 1000 * (time.perf_counter() - self.t_gen) if self.t_gen is not None else 0.0

        def per_token(ms: float, n: int) -> float | None:
            return round(ms / n, 3) if n else None

        def per_second(ms: float, n: int) -> float | None:
            return round(1000 * n / ms, 2) if ms > 0 else None

        ms_step = 1000 * self.step_seconds / self.steps if self.steps else None
        return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
                "prompt_per_second": per_second(prompt_ms, prompt_n),
                "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": per_token(predicted_ms, predicted_n),
                "predicted_per_second": per_second(predicted_ms, predicted_n),
                "diffusion": {"blocks": len(self.steps_per_block), "steps": self.steps,
                              "steps_per_block": list(self.steps_per_block), "canvas_tokens": self.canvas,
                              "ms_per_step": round(ms_step, 3) if ms_step is not None else None,
                              # tokens the decoder denoised per second: a canvas per step
                              "canvas_tokens_per_second": per_second(1000 * self.step_seconds,
                                                                     self.canvas * self.steps)}}


@dataclass
class Limits:
    """What one request may ask of the worker."""

    queue_size: int = 16  # requests that may wait behind the running one
    max_request_steps: int = 4096  # denoising steps x blocks per request (the work budget)
    max_request_seconds: float | None = None  # a request's generation stops after this (None: never)


class Engine:
    """The model behind the server: a :class:`ModelWorker` and what requests need to know.

    ``model`` and ``tokenizer`` are read by request handlers only for pure-Python work
    (chat template, tokenizer, sizes); every MLX call happens on the worker.
    """

    def __init__(self, model_path: str | None = None, demo: bool = False, dtype: str | None = None,
                 precision: str = "auto", model_id: str | None = None, limits: Limits | None = None,
                 memory_limit: int | None = None):
        self.limits = limits or Limits()
        self.memory_limit = memory_limit  # --memory-limit: the load's and every request's budget
        self.model_path, self.demo, self.dtype_name, self.precision_name = model_path, demo, dtype, precision
        self.precision = ""  # the label of what was loaded, e.g. "fast (bfloat16)"
        self.memory_bytes = 0  # memory in use after the last load or job (read on the worker: MLX stays there)
        self.model: Any = None
        self.tokenizer: Any = None
        self.generation_config: dict[str, Any] = {}
        self.canvas = self.context = 0
        self.max_token_bytes = 1  # the longest token's text in UTF-8 bytes: a prompt's least token count
        self.markers: tuple[int | None, int | None] = (None, None)
        self.model_id = model_id or (DEMO_MODEL_ID if demo else model_id_of(model_path))
        self.created = int(time.time())
        self.served = 0
        self.reused_prefixes = 0
        self.stopping = False
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "steps": 0,
                       "cancelled": 0, "refused": 0}
        self._session: Any = None  # the last conversation's ChatSession, if reusable
        self.runtime: Any = None  # the core's ModelRuntime: every rank runs the model calls (lockstep)
        self._durations: deque[float] = deque(maxlen=32)  # seconds of recent jobs (for Retry-After)
        self.worker: ModelWorker[None] = ModelWorker(self._load, max_waiting=self.limits.queue_size,
                                                     name="mlx-dgemma-engine", finish=self._finish)

    # lifecycle ------------------------------------------------------------
    def start(self) -> "Engine":
        """Start the worker and wait until the model is loaded (load errors are raised here)."""
        self.worker.start()
        return self

    def begin_shutdown(self) -> None:
        """The server is stopping: new requests get a 503, running and waiting ones stop at their
        next step and are answered with a final error (a stream ends with an error event)."""
        self.stopping = True
        self.worker.cancel_all()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel the running and waiting jobs at their next step and end the worker (bounded)."""
        return self.worker.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.worker.alive

    @property
    def busy(self) -> bool:
        return self.worker.busy

    @property
    def waiting(self) -> int:
        return self.worker.waiting

    def _load(self) -> None:
        from mlx_dgemma.lockstep import ModelRuntime
        from mlx_dgemma.memory import memory_bytes

        loaded = load_model(self.model_path, self.demo, self.dtype_name, self.precision_name, self.memory_limit)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.precision = loaded.precision.label
        self.generation_config = loaded.generation_config
        self.canvas = int(self.model.args.canvas_length)
        self.context = int(self.model.args.max_position_embeddings)
        self.max_token_bytes = max((len(t.encode("utf-8", "replace")) for t in self.tokenizer.tokens), default=1)
        self.markers = marker_ids(self.tokenizer)
        self.memory_bytes = memory_bytes()
        self.runtime = ModelRuntime(loaded)

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
        try:
            self.worker.submit(lambda t: self._run_job(job, t), skipped=lambda t: self._skip(job),
                               cancel=job.cancel)
        except WorkerBusy as e:
            self.totals["refused"] += 1
            wait = self.retry_after()
            raise APIError(503, f"server busy: {e.waiting} requests are waiting; retry in {wait} s",
                           type="server_error", code="server_busy", headers={"Retry-After": str(wait)}) from None
        except WorkerStopped:
            raise APIError(503, "the model worker is not running; restart the server", type="server_error",
                           code="engine_down") from None
        job.submitted = True

    def metrics(self) -> list[tuple[str, str, float, str]]:
        """(name, Prometheus type, value, help) for ``/metrics``."""
        t = self.totals
        return [("requests_served_total", "counter", self.served, "requests the worker ran to an end"),
                ("requests_cancelled_total", "counter", t["cancelled"], "requests stopped before their answer"),
                ("requests_refused_total", "counter", t["refused"], "requests refused with 503 (queue full)"),
                ("prompt_tokens_total", "counter", t["prompt_tokens"], "prompt tokens of answered requests"),
                ("prompt_tokens_cached_total", "counter", t["cached_tokens"], "prompt tokens taken from the cache"),
                ("completion_tokens_total", "counter", t["completion_tokens"], "tokens answered"),
                ("denoising_steps_total", "counter", t["steps"], "decoder passes (denoising steps)"),
                ("requests_waiting", "gauge", self.waiting, "requests waiting for the worker"),
                ("worker_busy", "gauge", int(self.busy), "1 while the worker runs a request"),
                ("memory_bytes", "gauge", self.memory_bytes, "memory the process holds after the last job")]

    # request preparation (handler threads; no MLX) ------------------------
    def sampler_overrides(self, req: Sampling, max_tokens: int | None) -> dict[str, Any]:
        """Request fields -> stream_generate parameters, validated as the core validates them.

        ``temperature`` scales the whole linear schedule (t_max -> t_min): 1 keeps the
        model's schedule, 0.5 halves both ends, 0 is taken as 0.01 (near-greedy: almost every
        position is accepted at the first step) with a fixed seed unless one is given."""
        from mlx_dgemma.sampler import SamplerParams

        over = {k: getattr(req, k) for k in SAMPLER_FIELDS if getattr(req, k) is not None}
        if max_tokens is not None:
            if max_tokens > self.context:  # beyond the context whatever the prompt: 413, not a range error
                raise ContextLengthError(f"max_tokens: {max_tokens} is beyond the model's context of "
                                         f"{self.context} tokens; lower max_tokens", "max_tokens")
            over["max_new_tokens"] = max_tokens
        if req.seed is not None:
            over["seed"] = req.seed
        elif req.temperature == 0:
            over["seed"] = GREEDY_SEED
        if req.temperature is not None and req.temperature != 1:
            base = SamplerParams.from_config(self.generation_config, **over)
            f = max(req.temperature, MIN_TEMPERATURE_FACTOR)
            # the core accepts temperatures from 0.001 (params.py): near-greedy, not below it
            over["t_min"] = max(base.t_min * f, 0.001)
            over["t_max"] = max(base.t_max * f, 2 * over["t_min"])
        try:
            SamplerParams.from_config(self.generation_config, **over).check_model(int(self.model.args.vocab_size))
        except ParameterError as e:
            if e.param == "t_max":  # the schedule: quote this model's defaults, not the reference's
                d = SamplerParams.from_config(self.generation_config)
                p = {**{"t_min": d.t_min, "t_max": d.t_max}, **over}
                raise APIError(400, f"t_min = {p['t_min']!r}, t_max = {p['t_max']!r}: the schedule needs "
                               f"0 < t_min < t_max (this model's defaults are {d.t_min} and {d.t_max})",
                               param="t_min" if "t_min" in over and "t_max" not in over else "t_max") from None
            raise APIError(400, str(e), param=e.param) from None
        return over

    def blocks_tokens(self, max_new_tokens: int) -> int:
        return math.ceil(max_new_tokens / self.canvas) * self.canvas

    def max_new_tokens(self, params: dict[str, Any]) -> int:
        return int(params.get("max_new_tokens") or self.generation_config.get("max_new_tokens") or 256)

    def fit(self, prompt_tokens: int, params: dict[str, Any], param: str = "messages") -> int | None:
        """Check a prompt of ``prompt_tokens`` against the context and the work budget; where
        the answer's blocks do not all fit, cap ``max_new_tokens`` (in ``params``) to the whole
        blocks that do (the answer then ends with finish_reason "length"). Returns the cap."""
        from mlx_dgemma.sampler import SamplerParams

        want = self.max_new_tokens(params)
        need = prompt_tokens + self.blocks_tokens(want)
        cap = None
        if need > self.context:
            room = (self.context - prompt_tokens) // self.canvas * self.canvas
            if room < self.canvas:
                raise ContextLengthError(
                    f"{param}: the prompt is {prompt_tokens} tokens and the answer needs at least one "
                    f"{self.canvas}-token block: {prompt_tokens + self.canvas} exceed the model's context of "
                    f"{self.context}; shorten the {param}", param)
            cap = params["max_new_tokens"] = min(want, room)
        steps = SamplerParams.from_config(self.generation_config, **params).max_denoising_steps
        blocks = self.blocks_tokens(self.max_new_tokens(params)) // self.canvas
        budget = self.limits.max_request_steps
        if steps * blocks > budget:
            field = "max_denoising_steps" if "max_denoising_steps" in params else "max_tokens"
            raise APIError(400, f"{field}: {steps} denoising steps x {blocks} blocks = {steps * blocks} steps is over "
                           f"this server's budget of {budget} per request (--max-request-steps); lower "
                           "max_denoising_steps or max_tokens", param=field, code="work_budget_exceeded")
        return cap

    def _check_size(self, texts: list[tuple[str, str]], total_param: str, rendered: bool = True,
                    fix: str | None = None) -> None:
        """Reject text that cannot fit before any rendering or tokenizing: every token holds at
        most ``max_token_bytes`` bytes of text, so N bytes are at least N / max_token_bytes tokens;
        ``rendered`` text must also fit the chat template's output budget."""
        for name, text in texts:
            if rendered and len(text) > RENDER_CHARS:
                raise ContextLengthError(f"{name}: {len(text)} characters; a prompt holds at most "
                                         f"{RENDER_CHARS} (the chat template's budget); shorten it", name)
        n_bytes = sum(len(t.encode("utf-8")) for _, t in texts)
        least = math.ceil(n_bytes / self.max_token_bytes)
        if least > self.context:
            raise ContextLengthError(f"{total_param}: {n_bytes} bytes of text are at least {least} tokens (a token "
                                     f"holds at most {self.max_token_bytes} bytes), beyond the model's context "
                                     f"of {self.context}; {fix or 'shorten the ' + total_param}", total_param)

    def template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """The chat template for ``messages``: the model's, or for tools where it has none the
        built-in Gemma 4 tool format (the demo model's template predates tools)."""
        t = self.tokenizer.chat_template
        return t if plain_chat(messages, tools) else template_for_tools(t)

    def prepare_chat(self, messages: list[dict[str, Any]], enable_thinking: bool, params: dict[str, Any],
                     tools: list[dict[str, Any]] | None = None) -> int:
        """Render the whole conversation as a fresh prompt: template errors are 400, a prompt
        beyond the context 413. Returns its token count."""
        texts = [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
        self._check_size(texts, "messages")
        if tools:  # the messages fit: where the tools are what does not, they are named
            self._check_size(texts + [("tools", json.dumps(tools, ensure_ascii=False))], "tools",
                             fix=TOOLS_FIX)
        n = self._prompt_tokens(messages, enable_thinking, tools)
        try:
            self.fit(n, params)
        except ContextLengthError:
            if not tools:
                raise
            n0 = self._prompt_tokens(messages, enable_thinking, None)
            if n0 + self.canvas > self.context:  # too long without the tools too: the messages' error
                raise
            raise ContextLengthError(
                f"tools: the prompt is {n} tokens, {n - n0} of them the tools' declarations, and the answer "
                f"needs at least one {self.canvas}-token block: {n + self.canvas} exceed the model's context of "
                f"{self.context}; {TOOLS_FIX}", "tools") from None
        return n

    def _prompt_tokens(self, messages: list[dict[str, Any]], enable_thinking: bool,
                       tools: list[dict[str, Any]] | None) -> int:
        """The rendered prompt's token count; template errors are 400."""
        try:
            text = render_chat(messages, self.template(messages, tools), enable_thinking=enable_thinking, tools=tools)
        except ParameterError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template's own error on odd input
            raise APIError(400, f"messages: the chat template cannot render them ({e})", param="messages") from None
        return len(self.tokenizer.encode(text))

    def prepare_completion(self, prompt: str | list[int], params: dict[str, Any]) -> list[int]:
        if isinstance(prompt, str):
            self._check_size([("prompt", prompt)], "prompt", rendered=False)
            ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            V = int(self.model.args.vocab_size)
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < V), None)
            if bad is not None:
                raise APIError(400, f"prompt[{bad}]: token id {prompt[bad]} is outside [0, {V})",
                               param=f"prompt[{bad}]")
            ids = list(prompt)
        self.fit(len(ids), params, "prompt")
        return ids

    # generation (worker thread) ------------------------------------------
    def _skip(self, job: Job) -> None:
        """The client left while its request waited: it never runs (a cancelled request all the same)."""
        self.totals["cancelled"] += 1
        job.stats.update(finish="cancelled", steps=0)
        job.emit(*(("error", self._shutdown_error()) if self.stopping else ("done", None)))
        job.release()

    def _run_job(self, job: Job, ticket: Ticket) -> None:
        from mlx_dgemma.memory import memory_bytes

        t0 = job.started = time.perf_counter()
        try:
            self._run_chat(job) if job.kind == "chat" else self._run_completion(job)
        except APIError as e:
            job.emit("error", e)
        except DGemmaError as e:
            job.emit("error", APIError(400, str(e), param=getattr(e, "param", None)))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the worker
            log.exception("engine error")
            self._session = None
            job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
        finally:
            seconds = time.perf_counter() - t0
            job.stats["engine_s"] = round(seconds, 4)
            self.memory_bytes = memory_bytes()
            self.served += 1
            self._durations.append(seconds)
            job.release()

    def _cancelled(self, job: Job) -> Any:
        """The cancel check the core polls: the client left, or the request ran out of time."""
        limit = self.limits.max_request_seconds
        if limit is None:
            return job.cancel.is_set

        def check() -> bool:
            if job.cancel.is_set():
                return True
            if time.perf_counter() - job.started > limit:
                job.stats["timeout"] = True
                return True
            return False

        return check

    @staticmethod
    def _core_params(job: Job) -> dict[str, Any]:
        """The job's parameters for the core: the sampler's, and ``logprobs`` only when asked."""
        return {**job.params, "logprobs": job.logprobs} if job.logprobs is not None else job.params

    def _run_completion(self, job: Job) -> None:
        events = self.runtime.generate(job.prompt, chat=False, cancel=self._cancelled(job), **self._core_params(job))
        self._consume(job, events, lambda: 0)

    def _run_chat(self, job: Job) -> None:
        rt = self.runtime
        if not plain_chat(job.prompt, job.tools):
            # tools, tool calls or results: a fresh render (the session continues user turns only)
            self._session = None
            text = render_chat(job.prompt, self.template(job.prompt, job.tools), enable_thinking=job.enable_thinking,
                               tools=job.tools)
            events = rt.generate(self.tokenizer.encode(text), chat=False, cancel=self._cancelled(job),
                                 **self._core_params(job))
            self._consume(job, events, lambda: 0)
            return
        earlier, user = job.prompt[:-1], job.prompt[-1]["content"]
        s, self._session = self._session, None  # reusable again only if this turn ends cleanly
        if s is None or s is not rt.session or s.enable_thinking != job.enable_thinking:
            rt.new_chat(enable_thinking=job.enable_thinking)  # on every rank, under mlx.launch
        s = rt.session
        # The session reuses its cache only where its tokens are a prefix of this conversation's
        # fresh render (another client's conversation, an edited answer: encoded afresh), so the
        # answer never depends on what came before this request.
        result, clean = self._consume(job, rt.chat(user, cancel=self._cancelled(job), messages=earlier,
                                                   **self._core_params(job)), lambda: s.cached_tokens)
        if clean and result is not None:
            self._session = s

    def _consume(self, job: Job, events: Iterator[Any], cached_tokens: Callable[[], int]) -> tuple[Result | None, bool]:
        """Drive one generation, emitting block texts (and steps if asked) and the result as
        soon as the last block is committed: the client does not wait for the cache commit
        that follows it (that is for the next turn). Returns the result (None if cancelled)
        and whether the generator ran to its end."""
        from mlx_dgemma.events import BlockEvent, PrefillEvent, StepEvent
        from mlx_dgemma.sampler import SamplerParams

        eos = SamplerParams.from_config(self.generation_config, **job.params).eos_token_id  # as the core reads it
        answer = Answer(self.tokenizer, eos, job.max_tokens, job.stop, self.markers, tools=bool(job.tools),
                        raw=job.kind != "chat")
        n_blocks = self.blocks_tokens(self.max_new_tokens(job.params)) // self.canvas
        result: Result | None = None
        prefill = 0
        clean = True
        clock = Timings(self.canvas)
        entries: list[dict[str, Any]] = []  # with logprobs: one per generated token, in order

        def logprobs() -> tuple[dict[str, Any], ...] | None:
            """The counted tokens' entries (as many as completion_tokens: a stop cut, max_tokens
            and the padding after EOS leave out the same tokens)."""
            return tuple(entries[:answer.completion_tokens]) if job.logprobs is not None else None

        def finish() -> Result:
            cached = cached_tokens()  # known once the generation has started
            if cached:
                self.reused_prefixes += 1  # before the answer goes out: /health agrees with it
            usage = {"prompt_tokens": cached + prefill, "completion_tokens": answer.completion_tokens,
                     "total_tokens": cached + prefill + answer.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached},
                     "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens}}
            self.totals["prompt_tokens"] += cached + prefill
            self.totals["cached_tokens"] += cached
            self.totals["completion_tokens"] += answer.completion_tokens
            job.stats.update(prompt=cached + prefill, cached=cached, completion=answer.completion_tokens,
                             reasoning=answer.reasoning_tokens, finish=answer.finish_reason)
            r = Result(answer.content, answer.reasoning, answer.finish_reason, usage, tuple(answer.tool_calls),
                       logprobs(), clock.timings(cached, prefill, answer.completion_tokens), answer.finish_detail)
            job.stats["answer_s"] = round(time.perf_counter() - job.started, 4)
            job.answered = True
            job.emit("done", r)
            return r

        for ev in events:
            if isinstance(ev, StepEvent):
                clock.step(ev.seconds)
                if job.stream_steps:
                    job.emit("step", self._step_payload(ev))
            elif isinstance(ev, BlockEvent):
                clock.block(ev.steps)
                answer.add(ev.tokens, ev.text, ev.thinking, ev.end)
                if job.logprobs is not None and ev.logprobs is not None:
                    entries += [self._logprob_entry(t, lp, ids, lps) for t, lp, ids, lps in
                                zip(ev.tokens, ev.logprobs.tolist(), ev.top_ids.tolist(), ev.top_logprobs.tolist())]
                if job.stream_steps:
                    job.emit("step", {"type": "block", "block": ev.block, "steps": ev.steps, "finished": ev.finished,
                                      **({"end": ev.end} if ev.end else {})})
                # a snapshot: the worker goes on mutating answer
                job.emit("text", (*answer.streamable(), tuple(answer.tool_calls), logprobs()))
                last = ev.finished or ev.block >= n_blocks  # blocks count from 1
                if (answer.stop_hit or answer.eos) and not last:  # a stop string, or a call's end
                    clean = False  # a stop string: no need for more blocks
                    result = finish()
                    break
                if last and result is None:
                    result = finish()
            elif isinstance(ev, PrefillEvent):
                prefill = ev.tokens
                clock.prefilled(ev.seconds)
                job.stats.update(prefill=ev.tokens, prefill_s=round(ev.seconds, 4))
        if not clean:
            getattr(events, "close", lambda: None)()  # ends the core's generator at its current yield
        # the log line and /metrics read the same clock as the answer's timings (the core's DoneEvent
        # never comes when a stop string ends the generator early)
        self.totals["steps"] += clock.steps
        job.stats["steps"] = clock.steps
        if clock.steps:
            job.stats.update(s_per_step=round(clock.step_seconds / clock.steps, 4),
                             tok_per_fwd=round(answer.completion_tokens / clock.steps, 2))
        if result is None and job.stats.get("timeout") and not job.cancel.is_set():
            result = finish()  # --max-request-seconds: what is committed, finish_reason "length"
            clean = False
        if result is None:  # cancelled (the client left, or the server stops) before the last block
            self.totals["cancelled"] += 1
            job.stats.update(finish="cancelled")
            job.emit(*(("error", self._shutdown_error()) if self.stopping else ("done", None)))
            return None, False
        return result, clean

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token as OpenAI's logprobs show it: its text and its UTF-8 bytes (a byte that is not
        a whole character on its own is written ``\\xNN`` in the text; the bytes are exact)."""
        b = self.tokenizer.token_bytes(token_id)
        return b.decode("utf-8", "backslashreplace"), list(b)

    def _logprob_entry(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> dict[str, Any]:
        text, raw = self._token_text(token_id)
        top = []
        for t, lp in zip(top_ids, top_lps):
            tt, tb = self._token_text(t)
            top.append({"token": tt, "logprob": lp, "bytes": tb})
        return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top}

    def _step_payload(self, ev: Any) -> dict[str, Any]:
        tok = self.tokenizer
        draft = ev.draft.tolist()
        return {"type": "step", "block": ev.block, "step": ev.step, "max_steps": ev.max_steps,
                "draft": tok.decode(draft), "tokens": [tok.piece(t) for t in draft],
                "accepted": ev.accepted.astype(int).tolist(), "mean_entropy": round(float(ev.mean_entropy), 6),
                "temperature": round(float(ev.temperature), 6)}
