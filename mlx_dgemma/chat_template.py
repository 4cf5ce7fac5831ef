"""Chat prompts (the GGUF's Jinja template, rendered as transformers renders it) and the
parsing of answers into thought channel and visible text."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import ParameterError

# Used when a file carries no template: the Gemma 4 turn format. With thinking off the
# generation prompt closes an empty thought channel, as the published template does.
# Tools follow Gemma 4's format: declarations in the system turn
# (``<|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|>``), a call in
# the model's turn (``<|tool_call>call:NAME{key:value,...}<tool_call|>``), its result in the
# same turn (``<|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|>``), after
# which the model goes on with its turn. Values: strings between ``<|"|>``, bare numbers,
# true/false/null, ``{key:value,...}`` with sorted bare keys, ``[...]``; schema types upper-case.
DEFAULT_TEMPLATE = (
    r"{% macro arg(v, key='') %}{% if v is string %}{{ '<|\"|>' + ((v | upper) if key == 'type' else v) + '<|\"|>' }}"
    r"{% elif v is boolean %}{{ 'true' if v else 'false' }}{% elif v is none %}{{ 'null' }}"
    r"{% elif v is mapping %}{{ '{' }}{% for k, x in v | dictsort %}{{ k + ':' }}{{ arg(x, k) }}"
    r"{% if not loop.last %}{{ ',' }}{% endif %}{% endfor %}{{ '}' }}"
    r"{% elif v is iterable %}{{ '[' }}{% for x in v %}{{ arg(x) }}{% if not loop.last %}{{ ',' }}{% endif %}"
    r"{% endfor %}{{ ']' }}{% else %}{{ v }}{% endif %}{% endmacro %}"
    r"{{ bos_token }}"
    r"{% set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    r"{% if enable_thinking or sys is not none or tools %}{{ '<|turn>system\n' }}"
    r"{% if enable_thinking %}{{ '<|think|>' }}{% endif %}{{ sys if sys is not none else '' }}"
    r"{% for t in tools or [] %}{% set f = t['function'] %}{{ '<|tool>declaration:' + f['name'] + '{' }}"
    r"{{ 'description:' + arg(f['description'] or '') }}"
    r"{% if f['parameters'] %}{{ ',parameters:' + arg(f['parameters']) }}{% endif %}{{ '}<tool|>' }}{% endfor %}"
    r"{{ '<turn|>\n' }}"
    r"{% endif %}"
    r"{% for m in messages if m['role'] != 'system' %}"
    r"{% set prev = loop.previtem['role'] if loop.previtem is defined else none %}"
    r"{% set next = loop.nextitem['role'] if loop.nextitem is defined else none %}"
    r"{% if m['role'] == 'tool' %}"
    r"{{ '<|tool_response>response:' + (m['name'] or 'unknown') + '{value:' + arg(m['content']) }}"
    r"{{ '}<tool_response|>' }}"
    r"{% if next is not none and next not in ('tool', 'assistant') %}{{ '<turn|>\n' }}{% endif %}"
    r"{% else %}"
    r"{% if not (m['role'] == 'assistant' and prev == 'tool') %}"
    r"{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}{% endif %}"
    r"{{ m['content'] | trim }}"
    r"{% for c in m['tool_calls'] or [] %}{{ '<|tool_call>call:' + c['function']['name'] }}"
    r"{% set a = c['function']['arguments'] %}{{ arg(a) if a is mapping else '{' + a + '}' }}"
    r"{{ '<tool_call|>' }}{% endfor %}"
    r"{% if not (m['tool_calls'] and next == 'tool') %}{{ '<turn|>\n' }}{% endif %}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}{{ '<|turn>model\n' }}"
    r"{% if not enable_thinking %}{{ '<|channel>thought\n<channel|>' }}{% endif %}{% endif %}"
)

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"


def _raise(message: str):
    raise ParameterError(f"chat template: {message}")


# Rendering budget: a template is data from a downloaded file, so it runs sandboxed and bounded
# (a normal chat prompt renders in milliseconds and a few loop iterations per message).
RENDER_SECONDS = 2.0
# Characters a template may write besides the messages' own text (which it may write twice).
RENDER_CHARS = 4_000_000
# The messages' text, all together: checked before rendering, so that a prompt too long is
# named as such and not blamed on the template (English runs ~4 characters a token: 4M
# characters are about four times the published model's context of 262,144 tokens).
PROMPT_CHARS = 4_000_000
RENDER_ITERATIONS = 1_000_000  # items of every range() and repeated sequence, summed
_budget = threading.local()


def _over_budget(what: str) -> None:
    raise ParameterError(f"chat template: rendering exceeded its budget ({what}); the template loops too "
                         "much, fix or remove it")


def _tick(n: int = 0) -> None:
    b = getattr(_budget, "state", None)
    if b is None:
        return
    if n:
        b[1] += n
        if b[1] > RENDER_ITERATIONS:
            _over_budget(f"more than {RENDER_ITERATIONS:,} loop iterations")
    if time.perf_counter() > b[0]:
        _over_budget(f"{RENDER_SECONDS:g} s")


def _sized(n: Any) -> int:
    return len(n) if isinstance(n, (str, list, tuple)) else 0


@lru_cache(maxsize=8)
def compile_template(template: str):
    """A chat template compiled as transformers compiles it (errors are raised, not rendered)."""
    # The environment transformers uses for chat templates (sandboxed, trim/lstrip blocks,
    # loop controls, tojson, raise_exception, strftime_now), with a budget on every attribute,
    # item, call, range and repetition, so a hostile template cannot hang or exhaust memory.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*" and (_sized(left) or _sized(right)):
                count = right if _sized(left) else left
                if isinstance(count, int) and count > 0:
                    _tick(count * max(1, _sized(left) or _sized(right)) // 64 + count)
            if operator == "**" and isinstance(right, int) and abs(right) > 1024:
                _over_budget("an exponent above 1024")
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _tick()
            return super().call(__context, __obj, *args, **kwargs)

    def budgeted_range(*args: int):
        r = safe_range(*args)
        _tick(len(r))
        return r

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: \
        __import__("json").dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                                 sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = budgeted_range
    return env.from_string(template)


def _text_chars(content: Any) -> int:
    """Characters of text in a message's content: a string, or (multimodal) lists and dicts of them."""
    total, stack = 0, [content]
    while stack:  # iterative: a deeply nested content cannot exhaust the stack
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):  # a part: {"type": "text", "text": ...}; its labels are not text
            stack.extend(v for k, v in x.items() if k in ("text", "content"))
    return total


def check_prompt_length(messages: list[dict[str, Any]]) -> int:
    """The messages' text against :data:`PROMPT_CHARS`; the error names the longest message.
    Returns the characters of text in all."""
    sizes = [_text_chars(m.get("content")) for m in messages]
    total = sum(sizes)
    if total > PROMPT_CHARS:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        role = messages[i].get("role")
        role = role if isinstance(role, str) and role.isidentifier() else "the"
        whole = "" if sizes[i] == total else f" ({total:,} in all)"
        raise ParameterError(f"messages[{i}]: the {role} message has {sizes[i]:,} characters{whole}, more than a "
                             f"prompt may have ({PROMPT_CHARS:,}); shorten it",
                             param="messages", rule=f"at most {PROMPT_CHARS:,} characters of text")
    return total


def _render(template: str, text_chars: int = 0, **variables: Any) -> str:
    """Render within the budget (``RENDER_CHARS`` plus twice the messages' ``text_chars``);
    template errors become one-line ParameterErrors."""
    from jinja2 import TemplateError

    try:
        compiled = compile_template(template)
    except TemplateError as e:
        raise ParameterError(f"chat template: does not compile ({e.__class__.__name__}"
                             f"{f' at line {e.lineno}' if getattr(e, 'lineno', None) else ''}: {e}); fix or "
                             "remove it") from None
    _budget.state = [time.perf_counter() + RENDER_SECONDS, 0]
    out: list[str] = []
    size, limit = 0, RENDER_CHARS + 2 * text_chars
    try:
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > limit:
                _over_budget(f"more than {limit:,} characters of output")
            out.append(chunk)
            _tick()
    except ParameterError:
        raise
    except TemplateError as e:
        raise ParameterError(f"chat template: {e.__class__.__name__}: {e}; fix or remove it") from None
    except (RecursionError, MemoryError, OverflowError) as e:
        _over_budget(e.__class__.__name__)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
        raise ParameterError(f"chat template: fails on these messages ({e.__class__.__name__}: {e}); fix or "
                             "remove it") from None
    finally:
        _budget.state = None
    return "".join(out)


def render_chat(messages: list[dict[str, Any]], template: str | None = None, *,
                add_generation_prompt: bool = True, enable_thinking: bool = False,
                bos_token: str = "<bos>", eos_token: str = "<eos>", tools: list[dict] | None = None,
                documents: list[dict] | None = None, **extra: Any) -> str:
    """Render ``messages`` ([{'role', 'content'}]) into the prompt text (sandboxed, with a
    budget of time, loop iterations and output size)."""
    if not messages:
        raise ParameterError("messages: empty; give at least one {'role': 'user', 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ParameterError(f"messages[{i}]: expected a dict with 'role' and 'content'")
    text_chars = check_prompt_length(messages)  # before rendering: a long prompt is not the template's fault
    return _render(template or DEFAULT_TEMPLATE, text_chars,
                   messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                   enable_thinking=enable_thinking, bos_token=bos_token, eos_token=eos_token, **extra)


TOOL_CALL_OPEN, TOOL_CALL_CLOSE, STRING_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
TOOL_RESPONSE_OPEN = "<|tool_response>"
_CALL = re.compile(r"call:([A-Za-z_][A-Za-z0-9_.\-]*)(\{.*\})\s*", re.DOTALL)
_BARE = re.compile(r"[^,:{}\[\]\s]+")


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """One value of Gemma 4's argument syntax at ``s[i]``: ``<|"|>text<|"|>``, a JSON string,
    ``{key:value,...}``, ``[value,...]``, true/false/null or a number. ValueError if malformed."""
    import json

    while i < len(s) and s[i].isspace():
        i += 1
    if s.startswith(STRING_QUOTE, i):
        end = s.find(STRING_QUOTE, i + len(STRING_QUOTE))
        if end == -1:
            raise ValueError("unclosed string")
        return s[i + len(STRING_QUOTE): end], end + len(STRING_QUOTE)
    if s.startswith('"', i):
        return json.JSONDecoder().raw_decode(s, i)
    if s.startswith("{", i) or s.startswith("[", i):
        is_obj, out, i = s[i] == "{", ({} if s[i] == "{" else []), i + 1
        close = "}" if is_obj else "]"
        while True:
            while i < len(s) and s[i].isspace():
                i += 1
            if s.startswith(close, i) and not out:
                return out, i + 1
            if is_obj:
                if s.startswith(STRING_QUOTE, i) or s.startswith('"', i):
                    key, i = _gemma_value(s, i)
                else:
                    m = _BARE.match(s, i)
                    if not m:
                        raise ValueError(f"a key expected at {i}")
                    key, i = m.group(), m.end()
                if not s.startswith(":", i):
                    raise ValueError(f"':' expected at {i}")
                out[key], i = _gemma_value(s, i + 1)
            else:
                v, i = _gemma_value(s, i)
                out.append(v)
            while i < len(s) and s[i].isspace():
                i += 1
            if s.startswith(",", i):
                i += 1
            elif s.startswith(close, i):
                return out, i + 1
            else:
                raise ValueError(f"',' or {close!r} expected at {i}")
    m = _BARE.match(s, i)
    if not m:
        raise ValueError(f"a value expected at {i}")
    return json.loads(m.group()), m.end()  # true, false, null, a number (JSONDecodeError is a ValueError)


def parse_tool_call(body: str) -> ToolCall | None:
    """``call:NAME{key:value,...}`` (a tool-call block's body) -> a ToolCall, None if malformed."""
    import json

    m = _CALL.fullmatch(body.strip())
    if not m:
        return None
    try:
        args, end = _gemma_value(m.group(2), 0)
    except (ValueError, RecursionError):
        return None
    if end != len(m.group(2)) or not isinstance(args, dict):
        return None
    return ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))


def split_tool_calls(text: str) -> tuple[list[str | ToolCall], bool]:
    """Gemma 4 tool-call blocks (``<|tool_call>call:NAME{...}<tool_call|>``) out of decoded
    text (specials kept): the pieces in order (text, or a ToolCall for each well-formed block;
    a malformed block stays text), and whether an unclosed block trails (cut off; not in the
    pieces: it may still become a call)."""
    pieces: list[str | ToolCall] = []
    i = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, i)
        if start == -1:
            pieces.append(text[i:])
            return pieces, False
        end = text.find(TOOL_CALL_CLOSE, start)
        pieces.append(text[i:start])
        if end == -1:
            return pieces, True
        block = text[start: end + len(TOOL_CALL_CLOSE)]
        call = parse_tool_call(block[len(TOOL_CALL_OPEN): -len(TOOL_CALL_CLOSE)])
        pieces.append(call if call is not None else block)
        i = end + len(TOOL_CALL_CLOSE)


def template_for_tools(template: str | None) -> str:
    """The template to render tools and tool messages with: the model's, unless it knows
    nothing of tools (it would drop the declarations and show results as a turn of an unknown
    role), then the built-in Gemma 4 format, whose tokens every Gemma 4 vocabulary holds."""
    return template if template and "tool" in template else DEFAULT_TEMPLATE


@dataclass(frozen=True)
class ParsedAnswer:
    thinking: str  # text of the thought channel ('' when none)
    answer: str  # the visible answer, special tokens removed
    thinking_open: bool = False  # a thought channel began and has not closed yet


_SPECIAL = re.compile(r"<\|[a-z_\"]*>|<[a-z_\"]*\|>|<(?:bos|eos|pad|mask|unk)>|<\|\"\|>")


def strip_specials(text: str) -> str:
    return _SPECIAL.sub("", text)


def parse_answer(text: str, strip: bool = True) -> ParsedAnswer:
    """Split ``<|channel>thought ... <channel|>`` from the answer (text decoded with specials).
    ``strip=False`` keeps the answer's surrounding whitespace (a raw completion continues its
    prompt: its leading space is part of the text)."""
    thinking, rest, is_open = "", text, False
    start = text.find(THOUGHT_OPEN)
    if start != -1:
        end = text.find(THOUGHT_CLOSE, start)
        body = text[start + len(THOUGHT_OPEN): end if end != -1 else len(text)]
        if body.startswith("thought"):
            body = body[len("thought"):]
        thinking = strip_specials(body).strip()
        rest = text[:start] + (text[end + len(THOUGHT_CLOSE):] if end != -1 else "")
        is_open = end == -1
    for stop in ("<turn|>", "<eos>", "<|tool_response>"):
        cut = rest.find(stop)
        if cut != -1:
            rest = rest[:cut]
    rest = strip_specials(rest)
    return ParsedAnswer(thinking, rest.strip() if strip else rest, is_open)
