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
DEFAULT_TEMPLATE = (
    r"{{ bos_token }}"
    r"{% set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    r"{% if enable_thinking or sys is not none %}{{ '<|turn>system\n' }}"
    r"{% if enable_thinking %}{{ '<|think|>' }}{% endif %}{{ sys if sys is not none else '' }}{{ '<turn|>\n' }}"
    r"{% endif %}"
    r"{% for m in messages if m['role'] != 'system' %}"
    r"{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + (m['content'] | trim)"
    r" + '<turn|>\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|turn>model\n' }}"
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


@dataclass(frozen=True)
class ParsedAnswer:
    thinking: str  # text of the thought channel ('' when none)
    answer: str  # the visible answer, special tokens removed
    thinking_open: bool = False  # a thought channel began and has not closed yet


_SPECIAL = re.compile(r"<\|[a-z_\"]*>|<[a-z_\"]*\|>|<(?:bos|eos|pad|mask|unk)>|<\|\"\|>")


def strip_specials(text: str) -> str:
    return _SPECIAL.sub("", text)


def parse_answer(text: str) -> ParsedAnswer:
    """Split ``<|channel>thought ... <channel|>`` from the answer (text decoded with specials)."""
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
    return ParsedAnswer(thinking, strip_specials(rest).strip(), is_open)
