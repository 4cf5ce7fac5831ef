"""Chat prompts (the GGUF's Jinja template, rendered as transformers renders it) and the
parsing of answers into thought channel and visible text."""

from __future__ import annotations

import re
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


@lru_cache(maxsize=8)
def _compile(template: str):
    # The environment transformers uses for chat templates (sandboxed, trim/lstrip blocks,
    # loop controls, tojson, raise_exception, strftime_now).
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: \
        __import__("json").dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                                 sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(messages: list[dict[str, Any]], template: str | None = None, *,
                add_generation_prompt: bool = True, enable_thinking: bool = False,
                bos_token: str = "<bos>", eos_token: str = "<eos>", tools: list[dict] | None = None,
                documents: list[dict] | None = None, **extra: Any) -> str:
    """Render ``messages`` ([{'role', 'content'}]) into the prompt text."""
    if not messages:
        raise ParameterError("messages: empty; give at least one {'role': 'user', 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ParameterError(f"messages[{i}]: expected a dict with 'role' and 'content'")
    return _compile(template or DEFAULT_TEMPLATE).render(
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
