"""The generating endpoints, each declared once: its path, its body (:mod:`.schemas`), how the
body becomes what the engine runs (a :class:`Shaped`: the prompt, the checked
:class:`~mlx_dgemma.request.GenerationRequest`), and its response kind's formatter
(:mod:`.openai`). :mod:`.app` derives the routes, the body each route's validation errors
name and the 404's ``ROUTES`` from :data:`ENDPOINTS`; the engine runs a :class:`Shaped`
whatever endpoint it came from.

A new endpoint is its body model, its formatter (or an existing one) and its row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mlx_dgemma.request import GenerationRequest

# the modules, not their names: a new row names its body and formatter without an import edit
from . import openai, schemas, toolcalls
from .errors import APIError
from .shaping import Shaping, check_last_message, normalize_messages, tools_for

V1 = "/v1"  # every endpoint also answers without it (clients configured with a bare base URL)


@dataclass(frozen=True)
class Shaped:
    """A request body as the engine runs it (an endpoint's ``shape``)."""

    kind: Literal["chat", "completion"]  # messages through the chat template, or token ids continued as they are
    prompt: Any  # normalized messages (chat) or token ids (completion)
    request: GenerationRequest  # checked, and capped to what fits after the prompt
    thinking: bool = False  # the chat template's thought channel on
    tools: list[dict[str, Any]] | None = None
    logprobs: int | None = None  # report the answer's log-probabilities, with this many top tokens each
    forced: toolcalls.Forced | None = None
    continued: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One generating endpoint: ``POST path`` (also without its ``/v1``) takes ``body``, which
    ``shape(engine, body)`` turns into a :class:`Shaped` (on a handler thread: its errors are
    the request's 400s), answered by a ``formatter`` per request."""

    path: str
    body: type[schemas.Sampling]
    shape: Callable[[Shaping, Any], Shaped]
    formatter: type[openai.Formatter]

    @property
    def paths(self) -> tuple[str, ...]:
        """The path, then the same without ``/v1`` (left out of the schema)."""
        return (self.path, self.path.removeprefix(V1)) if self.path.startswith(V1 + "/") else (self.path,)


def _thinking(body: schemas.ChatRequest) -> bool:
    if body.enable_thinking is not None:
        return body.enable_thinking
    v = (body.chat_template_kwargs or {}).get("enable_thinking", False)
    if not isinstance(v, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking: expected true or false",
                       param="chat_template_kwargs.enable_thinking")
    return v


def shape_chat(engine: Shaping, body: schemas.ChatRequest) -> Shaped:
    """A chat completion: the messages, tools and thinking switch, rendered and checked."""
    messages = normalize_messages(body.messages)
    tools = tools_for(body.tools, body.tool_choice)
    forced = toolcalls.Forced.of(tools, body.tool_choice)
    continued = check_last_message(messages)
    if continued and forced is not None:
        raise APIError(400, "tool_choice: a forced call cannot continue an assistant message; leave the last "
                       "assistant message out (or tool_choice)", param="tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    thinking = _thinking(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    wanted = engine.sampler_overrides(body, max_tokens, logprobs)
    gen = engine.prepare_chat(messages, thinking, wanted, tools, continued)
    return Shaped("chat", messages, gen, thinking, tools, logprobs, forced, continued)


def shape_completion(engine: Shaping, body: schemas.CompletionRequest) -> Shaped:
    """A text completion: the prompt's token ids, continued as they are."""
    wanted = engine.sampler_overrides(body, body.max_tokens, body.logprobs)
    ids, gen = engine.prepare_completion(body.prompt, wanted)
    return Shaped("completion", ids, gen, logprobs=body.logprobs)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/chat/completions", schemas.ChatRequest, shape_chat, openai.ChatFormatter),
    Endpoint("/v1/completions", schemas.CompletionRequest, shape_completion, openai.TextFormatter),
)
