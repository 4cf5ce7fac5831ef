"""A chat session's cache may change the speed of a turn, never its answer (issue 23, F4):
the cache holds only tokens that a fresh render of the conversation holds, so a follow-up
reuses it exactly where its tokens equal that render's (mlx-lm's prompt cache rule), and
``prompt_tokens`` counts the rendered prompt either way."""

from __future__ import annotations

import pytest

from mlx_dgemma import ChatSession, load
from mlx_dgemma.chat_template import render_chat
from mlx_dgemma.events import DoneEvent, PrefillEvent

SETTINGS = {"max_denoising_steps": 3, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load(tiny_model_dir, precision="exact")


def _turn(session: ChatSession, text: str, seed: int) -> tuple[DoneEvent, int]:
    events = list(session.stream(text, seed=seed, **SETTINGS))
    prefill = next(e for e in events if isinstance(e, PrefillEvent))
    return events[-1], prefill.tokens


def test_a_cache_hit_gives_the_fresh_answer_and_counts_the_rendered_prompt(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    a = ChatSession(rt)
    _turn(a, "Why is the sky blue?", seed=0)
    earlier = [dict(m) for m in a.messages]
    second, prefilled = _turn(a, "And the sunset?", seed=1)
    assert a.cached_tokens > 0 and prefilled < second.prompt_tokens + a.cached_tokens  # a real hit
    b = ChatSession(rt)  # the same conversation, sent fresh
    b.messages = earlier
    fresh, fresh_prefilled = _turn(b, "And the sunset?", seed=1)
    assert b.cached_tokens == 0
    assert a.cached_tokens + prefilled == fresh_prefilled  # the whole rendered prompt, hit or not
    assert second.tokens == fresh.tokens and second.text == fresh.text


def test_the_cache_holds_exactly_the_rendered_conversation(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    s = ChatSession(rt)
    for i, text in enumerate(["Hello", "Tell me more"]):
        _turn(s, text, seed=i)
        rendered = tok.encode(render_chat(s.messages, tok.chat_template, add_generation_prompt=False))
        assert s.history == rendered and s.cache.offset == len(rendered)  # no padding, no generation prompt


def test_another_conversation_is_encoded_afresh(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    s = ChatSession(rt)
    _turn(s, "Hello", seed=0)
    s.messages = [{"role": "user", "content": "Something else"}, {"role": "assistant", "content": "Yes."}]
    _turn(s, "Go on", seed=0)
    assert s.cached_tokens == 0
