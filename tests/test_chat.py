"""Chat templates rendered as transformers renders them, and answer parsing."""

from __future__ import annotations

import pytest

from mlx_dgemma.chat_template import DEFAULT_TEMPLATE, parse_answer, render_chat, strip_specials
from mlx_dgemma.errors import ParameterError

# A Gemma 4-style template exercising what real templates use: a system turn, thinking
# switch, loop controls, tojson, raise_exception, whitespace control.
GEMMA4_LIKE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' or enable_thinking or tools -%}
<|turn>system
{% if enable_thinking %}<|think|>{% endif %}
{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif %}
{%- if tools %}{% for t in tools %}<|tool>{{ t | tojson }}<tool|>{% endfor %}{% endif %}<turn|>
{% endif %}
{%- for message in messages -%}
  {%- if message['role'] == 'system' %}{% continue %}{% endif -%}
  {%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif -%}
<|turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}
{{ message['content'] | trim }}<turn|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|turn>model
{% if not enable_thinking %}<|channel>thought
<channel|>{% endif %}
{%- endif -%}"""

CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi  "},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}],
]


@pytest.mark.parametrize("template", [GEMMA4_LIKE, DEFAULT_TEMPLATE], ids=["gemma4-like", "default"])
@pytest.mark.parametrize("chat", CHATS, ids=["single", "multi"])
@pytest.mark.parametrize("thinking", [False, True])
def test_rendering_matches_transformers(template, chat, thinking):
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    tools = [{"name": "get_time", "parameters": {}}] if template is GEMMA4_LIKE else None
    want, _ = ctu.render_jinja_template([chat], chat_template=template, add_generation_prompt=True,
                                        tools=tools, bos_token="<bos>", eos_token="<eos>",
                                        enable_thinking=thinking)
    assert render_chat(chat, template, enable_thinking=thinking, tools=tools) == want[0]


def test_default_format_is_gemma4_turns():
    # The turn format from the reference notes, with thinking off.
    assert render_chat(CHATS[0]) == ("<bos><|turn>user\nWhy is the sky blue?<turn|>\n<|turn>model\n"
                                     "<|channel>thought\n<channel|>")
    assert render_chat(CHATS[0], enable_thinking=True) == (
        "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nWhy is the sky blue?<turn|>\n<|turn>model\n")


def test_template_errors_are_clear():
    with pytest.raises(ParameterError, match="bad role tool"):
        render_chat([{"role": "tool", "content": "x"}], GEMMA4_LIKE)
    with pytest.raises(ParameterError, match="messages"):
        render_chat([])


@pytest.mark.parametrize("raw,thinking,answer,is_open", [
    ("The sky is blue.<turn|><pad><pad>", "", "The sky is blue.", False),
    ("<|channel>thought\nRayleigh scattering.<channel|>Because of scattering.<turn|>",
     "Rayleigh scattering.", "Because of scattering.", False),
    ("<|channel>thought\nStill thinking", "Still thinking", "", True),
    ("Answer with <|\"|>quotes<|\"|> and <eos>junk", "", "Answer with quotes and", False),
])
def test_parse_answer(raw, thinking, answer, is_open):
    p = parse_answer(raw)
    assert (p.thinking, p.answer, p.thinking_open) == (thinking, answer, is_open)


def test_strip_specials_keeps_ordinary_text():
    assert strip_specials("a <b> c <|turn>d<turn|>") == "a <b> c d"
