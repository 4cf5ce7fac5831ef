"""Request bodies of the OpenAI API, as pydantic models FastAPI validates.

Strict like the OpenAI API ("0.5" is not a number, 1.0 not an integer), unknown fields
ignored (OpenAI clients send extras freely). Our sampler's settings are extra top-level
fields generated from the core's parameter registry (``mlx_dgemma.params``): each field's
type, range and description declared there once, and checked by the registry's own check, so
that a field's error reads its rule (``max_denoising_steps: must be an integer in [1, 10000]``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, create_model, field_validator

from mlx_dgemma import params
from mlx_dgemma.errors import ParameterError

# our sampler's settings (seed included), accepted as extra top-level request fields
SAMPLER_FIELDS = params.server_fields()


def _rule(p: params.Param, also: tuple[Any, str] | None = None) -> Any:
    """Generation parameter ``p`` as a request field: null (the model's default) or a value
    the registry's check takes (its type, its range), refused in the registry's words.
    ``also``: (a value, what it means) that the field takes besides, e.g. seed -1."""
    extra, meaning = also if also is not None else (None, "")
    rule = f"{p.rule}, or {extra} ({meaning})" if also is not None else p.rule

    def check(v: Any) -> Any:
        if v is None or also is not None and v == extra and type(v) is type(extra):
            return v
        try:
            params.check_generation_field(p.name, v)
        except ParameterError:
            raise ValueError(f"must be {rule}") from None
        return v

    return Annotated[Any, PlainValidator(check), Field(description=rule)]


def _quality() -> Any:
    """The speed/quality dial's setting as a request field: null (max, the model's own sampler)
    or one of the registry's names, refused in the registry's words."""

    def check(v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, str):
            raise ValueError(f"must be {params.QUALITY_RULE}")
        try:
            params.quality(v)
        except ParameterError:
            raise ValueError(f"must be {params.QUALITY_RULE}") from None
        return v

    return Annotated[Any, PlainValidator(check), Field(description=params.QUALITY_RULE)]


def check_unicode(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"): not text any tokenizer or response can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}; "
                         "send valid UTF-8 text") from None
    return text


# tool schemas and call arguments nested deeper than this are refused (400 naming the field): the
# chat template renders them recursively, and a few hundred levels exhaust Python's stack
MAX_JSON_DEPTH = 64


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON: dicts, lists, scalars) nests; iterative, so that any
    depth is measured without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def check_depth(value: Any) -> Any:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep; flatten it")
    return value


# Python's json reads NaN, Infinity and numbers beyond a double's range (1e999 is inf): none of
# them is a JSON value, and the chat template would render them into the prompt as such
NOT_FINITE = "not valid JSON: NaN/Infinity are not JSON values; send finite numbers"


def finite_json(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) holds no NaN or infinite number; iterative, as json_depth."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, (dict, list)):
            todo += v.values() if isinstance(v, dict) else v
    return True


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class DiffusionOptions(Body):
    stream_steps: bool = False


class FunctionCall(Body):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as text (OpenAI's form)


class ToolCall(Body):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _depth(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        v = check_depth(v)
        if not finite_json(v):
            raise ValueError(NOT_FINITE)
        return v


class Tool(Body):
    """An OpenAI function tool: ``{"type": "function", "function": {name, description, parameters}}``."""

    type: Literal["function"]
    function: FunctionDef


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this answers
    name: str | None = None  # tool messages: the function's name (else found from tool_call_id)

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> str:
        """A string, or a list of text parts (``[{"type": "text", "text": ...}]``)."""
        if v is None or isinstance(v, str):
            return check_unicode(v or "")
        if isinstance(v, list):
            out = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only {{'type': 'text', 'text': str}} parts are supported")
                out.append(part["text"])
            return check_unicode("".join(out))
        raise ValueError("expected a string or a list of text parts")


# registry parameters that OpenAI's API has too: declared among OpenAI's fields, not ours
_OPENAI_PARAMS = ("seed",)
MAX_STOPS = 64  # stop strings a request may give (OpenAI allows 4; agents' prompts send more)


def _openai_rule(p: params.Param) -> Any:
    """As :func:`_rule`; ``seed`` also takes -1, a random seed (llama.cpp's convention)."""
    return _rule(p, (-1, "random")) if p.name == "seed" else _rule(p)


def sampling_fields() -> type[Body]:
    """The fields chat and text completions share, in the order a request's first error is
    found: OpenAI's (``seed`` among them), then one per other registry parameter with
    ``server=True``, then the rest of ours."""
    ours = {p.name: (_rule(p), None) for p in params.PARAMS if p.server and p.name not in _OPENAI_PARAMS}
    theirs = {p.name: (_openai_rule(p), None) for p in params.PARAMS if p.server and p.name in _OPENAI_PARAMS}
    return create_model(
        "SamplingFields", __base__=Body,
        model=(str | None, None),
        max_tokens=(int | None, Field(None, ge=1)),  # beyond what fits: capped (finish_reason "length")
        temperature=(float | None, Field(None, ge=0, le=2)),
        top_p=(float | None, Field(None, ge=0, le=1)),  # accepted for compatibility; the sampler has no top-p
        **theirs,
        stop=(Any, Field(None, validate_default=True)),
        stream=(bool, False),
        stream_options=(StreamOptions | None, None),
        n=(int, 1),
        quality=(_quality(), None),  # the speed/quality dial; the fields in `ours` win over it
        **ours,
        diffusion=(DiffusionOptions | None, None),
        response_format=(Any, None),
    )


class Sampling(sampling_fields()):  # type: ignore[misc]  # fields generated from the registry
    """The fields chat and text completions share (:func:`sampling_fields`)."""

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: Any) -> Any:
        """Plain text only: a JSON answer cannot be guaranteed, so asking for one is refused
        rather than ignored."""
        if v is None or isinstance(v, dict) and v.get("type") == "text":
            return v
        kind = v.get("type") if isinstance(v, dict) else v
        raise ValueError(f"{kind!r} is not supported: this server cannot constrain the answer to JSON; "
                         "leave response_format out (or use {'type': 'text'}) and validate the answer yourself")

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
        if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
                not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"expected a non-empty string or a list of at most {MAX_STOPS} non-empty strings")
        return tuple(check_unicode(s) for s in stops)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None  # the answer's tokens' log-probabilities
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many most likely tokens each (with logprobs)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        """"auto", "none", "required" (a call to one of the tools) or a named function: the last
        two are held on the canvas (:mod:`mlx_dgemma.server.toolcalls`)."""
        if v is None or v in ("auto", "none", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str) and v["function"]["name"]:
            return v
        raise ValueError(f"{v!r} is not supported; use 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")


class CompletionRequest(Sampling):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's: log-probabilities with this many top tokens
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        """One answer per request (as ``n``): more candidates to choose from are refused rather
        than ignored."""
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported: this server generates one answer per request")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        """Text after the insertion (fill-in-the-middle) is not part of the prompt format this
        model was trained on; refused rather than ignored."""
        if v:
            raise ValueError("not supported: this model does not fill in the middle; leave suffix out")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None) -> bool | None:
        """The prompt is encoded, not predicted (the diffusion model scores no prompt token), so it
        cannot be echoed with log-probabilities; refused rather than ignored."""
        if v:
            raise ValueError("true is not supported: this server does not echo the prompt (the diffusion model "
                             "gives its tokens no log-probabilities); leave echo out and prepend the prompt yourself")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        """A string, a list of one string, or a list of token ids."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("empty; give some text")
            return check_unicode(v)
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("expected a non-empty string, a list of one string, or a list of token ids")
