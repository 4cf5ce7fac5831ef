"""Requests shaped for the core, on the request handlers' threads (no MLX): messages as the
chat template takes them, the tools it declares, the sampler's overrides, and the checks of a
prompt against the model's context and the server's work budget.

Every check here runs before a request reaches the model's worker, so a request that cannot
be answered is refused at once with the limit that applies (a prompt beyond the context is
OpenAI's ``context_length_exceeded``, which clients turn into their context error), and a
request that asks for more than fits is capped (``finish_reason: "length"``), not refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Mapping

from mlx_dgemma.chat_template import RENDER_CHARS, THOUGHT_OPEN, parse_answer, render_chat, template_for_tools
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.request import GenerationRequest

from .errors import APIError, ContextLengthError
from .schemas import MAX_JSON_DEPTH, NOT_FINITE, SAMPLER_FIELDS, Message, Sampling, finite_json, json_depth

MIN_TEMPERATURE_FACTOR = 0.01  # temperature 0 -> the schedule scaled by this (near-greedy)
GREEDY_SEED = 0  # temperature 0 without a seed: a fixed seed, so that the answer is reproducible
RANDOM_SEED = -1  # seed -1: a random seed (llama.cpp's and LM Studio's convention)
TOOLS_FIX = "send fewer or shorter tools (or tool_choice naming the one to use)"


@dataclass
class Limits:
    """What one request may ask of the worker (the defaults keep one request from holding the
    model for more than a few minutes: 300 s of its time, 4096 denoising steps)."""

    queue_size: int = 64  # requests that may wait for a turn
    max_request_steps: int = 4096  # denoising steps x blocks per request (the work budget): more is capped
    max_request_seconds: float | None = 300.0  # the model's time one request may take (None: no limit)
    parallel: int = 4  # requests that take turns at block boundaries (each holds its own KV cache)


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


def check_last_message(messages: list[dict[str, Any]]) -> bool:
    """What the conversation's last message asks for: an answer (a user's or a tool's message, or
    a system prompt alone) or, for an assistant's, its continuation. Returns whether it is
    continued; an empty user message, or an assistant's with tool calls, is a 400."""
    last = len(messages) - 1
    m = messages[-1]
    if m["role"] == "user" and not m["content"].strip():
        raise APIError(400, f"messages[{last}].content: empty; give some text", param=f"messages[{last}].content")
    if m["role"] != "assistant":
        return False
    if m.get("tool_calls"):
        raise APIError(400, f"messages[{last}]: an assistant message with tool calls cannot be continued; send "
                       "the calls' results as tool messages after it", param=f"messages[{last}]")
    return True


def tools_for(tools: list[Any] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the template declares: none with tool_choice "none", only the named one with a
    named function (a name not among ``tools`` is a 400), all of them otherwise; "required" or
    a named function without tools is a 400."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if not tools:
        if forced:
            raise APIError(400, "tool_choice: requires a call, but the request declares no tools; send them in "
                           "tools (or leave tool_choice out)", param="tool_choice")
        return None
    if tool_choice == "none":
        return None
    out = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        out = [t for t in out if t["function"]["name"] == name]
        if not out:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not among the request's tools",
                           param="tool_choice.function.name")
    return out


def plain_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """A conversation the core's ChatSession continues: no tools, only user/assistant text
    turns ending with the user's."""
    return not tools and messages[-1]["role"] == "user" and \
        all(m["role"] in ("system", "user", "assistant") and not m.get("tool_calls") for m in messages)


class Shaping:
    """The request checks of an :class:`~mlx_dgemma.server.engine.Engine` (a mixin: they read the
    loaded model's facts, ``context``, ``canvas``, ``tokenizer``, ``generation_config``, ``limits``)."""

    context: int
    canvas: int
    max_token_bytes: int
    tokenizer: Any
    model: Any
    generation_config: Mapping[str, Any]
    limits: Limits

    def sampler_overrides(self, req: Sampling, max_tokens: int | None,
                          logprobs: int | None = None) -> GenerationRequest:
        """Request fields -> the core's :class:`GenerationRequest`, checked as the core checks it
        (the registry's rules; an error names the request's field in the registry's words).

        ``temperature`` scales the whole linear schedule (t_max -> t_min): 1 keeps the
        model's schedule, 0.5 halves both ends, 0 is taken as 0.01 (near-greedy: almost every
        position is accepted at the first step) with a fixed seed unless one is given
        (``seed: -1`` is a random one). ``max_tokens`` beyond the context is capped to it
        (and to what fits after the prompt, by :meth:`fit`). ``logprobs``: the answer's
        log-probabilities, with this many most likely tokens each."""
        over = {k: getattr(req, k) for k in SAMPLER_FIELDS if getattr(req, k) is not None}
        if max_tokens is not None:
            over["max_new_tokens"] = min(max_tokens, self.context)
        if req.seed == RANDOM_SEED:
            over.pop("seed", None)
        elif req.seed is not None:
            over["seed"] = req.seed
        elif req.temperature == 0:
            over["seed"] = GREEDY_SEED
        try:
            if req.quality is not None:  # the dial's values under the fields given
                over = {**GenerationRequest.of(quality=req.quality).params, **over}
            if req.temperature is not None and req.temperature != 1:
                base = GenerationRequest.of(over).resolve(self.generation_config)
                f = max(req.temperature, MIN_TEMPERATURE_FACTOR)
                # the core accepts temperatures from 0.001 (params.py): near-greedy, not below it
                over["t_min"] = max(base.t_min * f, 0.001)
                over["t_max"] = max(base.t_max * f, 2 * over["t_min"])
            request = GenerationRequest.of(over, logprobs=logprobs)
            request.resolve(self.generation_config).check_model(int(self.model.args.vocab_size))
        except ParameterError as e:
            raise APIError(400, e.restated(e.param) if e.param else str(e), param=e.param) from None
        return request

    def blocks_tokens(self, max_new_tokens: int) -> int:
        return math.ceil(max_new_tokens / self.canvas) * self.canvas

    def max_new_tokens(self, request: GenerationRequest) -> int:
        return int(request.get("max_new_tokens") or self.generation_config.get("max_new_tokens") or 256)

    def context_error(self, param: str, detail: str, fix: str) -> ContextLengthError:
        """In the words clients match, besides the code: OpenAI's "maximum context length" (litellm) and
        "prompt is too long" (langchain-openai: with openai 3.x the code is no longer in the error's text)."""
        return ContextLengthError(f"{param}: the prompt is too long: this model's maximum context length is "
                                  f"{self.context} tokens; {detail}; {fix}", param)

    def fit(self, prompt_tokens: int, request: GenerationRequest, param: str = "messages") -> GenerationRequest:
        """Check a prompt of ``prompt_tokens`` against the context and the work budget; where
        the answer's blocks do not all fit either, cap ``max_new_tokens`` to the whole blocks
        that do (the answer then ends with finish_reason "length"). Returns ``request``, capped."""
        C = self.canvas
        room = (self.context - prompt_tokens) // C * C
        if room < C:
            raise self.context_error(param, f"the prompt is {prompt_tokens} tokens and the answer needs at least one "
                                     f"{C}-token block ({prompt_tokens + C} in all)", f"shorten the {param}")
        steps = request.resolve(self.generation_config).max_denoising_steps
        budget = self.limits.max_request_steps
        if steps > budget:
            raise APIError(400, f"max_denoising_steps: {steps} steps for one block is over this server's budget of "
                           f"{budget} steps per request (--max-request-steps); lower max_denoising_steps",
                           param="max_denoising_steps", code="work_budget_exceeded")
        # the work budget caps the blocks as the context does: a client's large default max_tokens
        # (8192 is common) gets what the server gives one request, not a refusal
        limit = min(room, budget // steps * C)
        want = self.max_new_tokens(request)
        if self.blocks_tokens(want) <= limit:
            return request
        return request.with_params(max_new_tokens=min(want, limit))

    def _check_size(self, texts: list[tuple[str, str]], total_param: str, rendered: bool = True,
                    fix: str | None = None) -> None:
        """Reject text that cannot fit before any rendering or tokenizing: every token holds at
        most ``max_token_bytes`` bytes of text, so N bytes are at least N / max_token_bytes tokens
        (the limit that applies first: the context); ``rendered`` text must also fit the chat
        template's output budget."""
        n_bytes = sum(len(t.encode("utf-8")) for _, t in texts)
        least = math.ceil(n_bytes / self.max_token_bytes)
        if least > self.context:
            most = self.context * self.max_token_bytes
            raise self.context_error(
                total_param, f"{n_bytes} bytes of text are at least {least} tokens (a token holds at most "
                f"{self.max_token_bytes} bytes, so at most {most} bytes can fit)",
                fix or "shorten the " + total_param)
        for name, text in texts:
            if rendered and len(text) > RENDER_CHARS:
                raise ContextLengthError(f"{name}: {len(text)} characters; a prompt holds at most "
                                         f"{RENDER_CHARS} (the chat template's budget); shorten it", name)

    def template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """The chat template for ``messages``: the model's, or for tools where it has none the
        built-in Gemma 4 tool format (the demo model's template predates tools)."""
        t = self.tokenizer.chat_template
        return t if plain_chat(messages, tools) else template_for_tools(t)

    def prompt_text(self, messages: list[dict[str, Any]], enable_thinking: bool,
                    tools: list[dict[str, Any]] | None, continued: bool = False) -> str:
        """The prompt as text: the conversation with the generation prompt, or, ``continued``,
        every message but the last (the assistant's) with the generation prompt, then that
        message's text as the start of the answer the model goes on with."""
        head = messages[:-1] if continued else messages
        text = render_chat(head, self.template(head, tools), enable_thinking=enable_thinking, tools=tools)
        return text + messages[-1]["content"] if continued else text

    def prepare_chat(self, messages: list[dict[str, Any]], enable_thinking: bool, request: GenerationRequest,
                     tools: list[dict[str, Any]] | None = None, continued: bool = False) -> GenerationRequest:
        """Render the whole conversation as a fresh prompt: template errors are 400, a prompt
        beyond the context ``context_length_exceeded``. Returns ``request`` capped to what fits
        after it (:meth:`fit`)."""
        texts = [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
        self._check_size(texts, "messages")
        if tools:  # the messages fit: where the tools are what does not, they are named
            self._check_size(texts + [("tools", json.dumps(tools, ensure_ascii=False))], "tools",
                             fix=TOOLS_FIX)
        n = self._prompt_tokens(messages, enable_thinking, tools, continued)
        try:
            return self.fit(n, request)
        except ContextLengthError:
            if not tools:
                raise
            n0 = self._prompt_tokens(messages, enable_thinking, None, continued)
            if n0 + self.canvas > self.context:  # too long without the tools too: the messages' error
                raise
            raise self.context_error(
                "tools", f"the prompt is {n} tokens, {n - n0} of them the tools' declarations, and the answer "
                f"needs at least one {self.canvas}-token block ({n + self.canvas} in all)", TOOLS_FIX) from None

    def _prompt_tokens(self, messages: list[dict[str, Any]], enable_thinking: bool,
                       tools: list[dict[str, Any]] | None, continued: bool = False) -> int:
        """The rendered prompt's token count; template errors are 400."""
        try:
            text = self.prompt_text(messages, enable_thinking, tools, continued)
        except ParameterError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template's own error on odd input
            raise APIError(400, f"messages: the chat template cannot render them ({e})", param="messages") from None
        return len(self.tokenizer.encode(text))

    def room_for(self, request: GenerationRequest, positions: int, max_tokens: int | None,
                 prompt_tokens: Callable[[], int]) -> GenerationRequest | None:
        """The request under which ``positions`` of a canvas template fit the answer: ``request``
        itself, or with more blocks where its max_new_tokens is fewer (within the context checked
        before: the first pass; ``prompt_tokens()``, counted only then; None if not)."""
        want = self.max_new_tokens(request)
        if self.blocks_tokens(want) >= positions:
            return request
        need = self.blocks_tokens(positions)
        if prompt_tokens() + need > self.context or (max_tokens is not None and max_tokens < positions):
            return None
        return request.with_params(max_new_tokens=need)

    def prepare_completion(self, prompt: str | list[int],
                           request: GenerationRequest) -> tuple[list[int], GenerationRequest]:
        """The prompt's token ids, checked against the vocabulary and the context, and
        ``request`` capped to what fits after it (:meth:`fit`)."""
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
        return ids, self.fit(len(ids), request, "prompt")
