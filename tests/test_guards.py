"""The answer guards (mlx_dgemma.guards): each rule as its seed states it, then each guard through
the generation loop (what is returned, what is committed to the cache, the finish reason) and
every front end (CLI, chat app, server), each with the registry parameter that turns it off."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import load
from mlx_dgemma.cache import KVCache
from mlx_dgemma.events import BlockEvent, DoneEvent, StepEvent
from mlx_dgemma.generation import _run
from mlx_dgemma.guards import (ENDINGS, GUARD_PARAMS, duplicate_cut, duplicate_half, empty_answer, loop_start,
                               unconverged)
from mlx_dgemma.runtime import Runtime
from mlx_dgemma.sampler import SamplerParams
from mlx_dgemma.step import StepFunction, step_key
from mlx_dgemma.trace import Trace
from tests.model_fakes import layerless_args

EOS = (1, 106, 50)
TURN_END, PAD = 106, 0

# -- the rules, from their seeds ---------------------------------------------------------------
# TensorSharp (DiffusionGemmaSampler.TrimCanvas): from each position i before the first end token
# (i + 1 < cut), a token equal to the one `stride` (1 or 2) further, 6 times in a row, is a loop.


@pytest.mark.parametrize("tokens,expected", [
    ([5, 6, 7] + [9] * 7 + [8], 3),  # 7 equal tokens: 6 repeats at stride 1, cut where the loop starts
    ([5, 6, 7] + [9] * 6 + [8], None),  # 6 equal tokens: 5 repeats, not a loop
    ([5] + [9, 3, 9, 4, 9, 6, 9, 7, 9, 8, 9, 2, 9], 1),  # 9 at every other position, 7 times (stride 2)
    ([5] + [9, 3, 9, 4, 9, 6, 9, 7, 9, 8, 9], None),  # 6 times at stride 2: 5 repeats
    ([9, 3, 3, 9, 3, 3, 9, 3, 3, 9, 3, 3, 9, 3, 3, 9, 3, 3, 9], None),  # stride 3 is not looked for
    ([5, 106] + [9] * 10, None),  # the run starts after the end token: not trimmed
    ([5, 9, 106] + [9] * 6, None),  # i + 1 < cut: the position just before the end token is not an onset
    ([5, 9, 9, 106, 9, 9, 9, 9, 9], None),  # a run cannot cross the end token itself (106 != 9)
    ([5, 9, 4, 9, 106, 9, 1, 9, 0, 9, 0, 9, 0, 9], 1),  # but the stride-2 run may reach past it, as there
])
def test_loop_start_follows_tensorsharp(tokens, expected):
    assert loop_start(tokens, EOS) == expected


def test_padding_is_an_end_not_a_loop():
    # the trained demo wrote "... heal." and 43 pads (no EOS): reported as a repetition loop
    pad = 0
    assert loop_start([5, 6, 7] + [pad] * 40, EOS) == 3  # without pad_id: the old reading
    assert loop_start([5, 6, 7] + [pad] * 40, EOS, pad_id=pad) is None
    assert loop_start([5] + [9] * 7 + [pad] * 10, EOS, pad_id=pad) == 1  # a loop before the padding still is one


def test_loop_start_counts_the_repeats_it_is_given_and_0_is_off():
    tokens = [5] + [9] * 4
    assert loop_start(tokens, EOS, repeats=3) == 1 and loop_start(tokens, EOS, repeats=4) is None
    assert loop_start([9] * 64, EOS, repeats=0) is None


# llama.cpp's DiffusionGemma PR (examples/diffusion-gemma): leading spaces/newlines/tabs stripped,
# half = len // 2; if half > 0 and the first half equals the last half, keep the first half.

@pytest.mark.parametrize("text,kept", [
    ("Amen. Amen.", "Amen."),  # odd length: the middle character (the separator) is in neither half
    ("abcabc", "abc"),  # even length: the halves meet
    ("abXab", "ab"),  # the middle character need not be a separator
    ("  \n Yea. Yea.", "  \n Yea."),  # leading whitespace is not compared, and kept
    ("Amen. Amen", None),  # "Amen." vs "Amen" (the last 4 after the middle): not equal halves
    ("Amen. amen.", None),  # exact: case counts
    ("a", None),  # half = 0
    ("", None),
    ("Amen, amen, I say unto thee", None),
])
def test_duplicate_half_follows_llama_cpp(text, kept):
    n = duplicate_half(text)
    assert (None if n is None else text[:n]) == kept


def test_duplicate_half_minimum_and_off():
    assert duplicate_half("ab ab", min_chars=2) == 2
    assert duplicate_half("ab ab", min_chars=3) is None
    assert duplicate_half("ab ab", min_chars=0) is None


def test_duplicate_cut_is_a_token_boundary_in_the_last_block():
    vocab = {1: "Amen.", 2: " Amen.", 3: " So", 4: " be", 5: " it.", 106: ""}

    def answer_of(ids):
        out = []
        for t in ids:
            if t == 106:
                break
            out.append(vocab[t])
        return "".join(out).strip()

    assert duplicate_cut([1, 2, 106, 0], answer_of, start=0) == 1
    assert duplicate_cut([1, 3, 4, 5, 2, 3, 4, 5, 106], answer_of, start=0) == 4
    assert duplicate_cut([1, 3, 4, 5, 2, 3, 4, 5, 106], answer_of, start=4) == 4  # the copy starts in the last block
    assert duplicate_cut([1, 3, 4, 5, 2, 3, 4, 5, 106], answer_of, start=6) is None  # it began in a committed block
    assert duplicate_cut([1, 3, 4, 106], answer_of, start=0) is None
    assert duplicate_cut([1, 2, 106], answer_of, start=0, min_chars=0) is None


def test_unconverged_and_empty_answer():
    assert unconverged(False, 0.6, 0.5) and not unconverged(False, 0.4, 0.5)
    assert not unconverged(True, 9.0, 0.5)  # the stopping rule was met
    assert not unconverged(False, 9.0, 0.0)  # off
    assert empty_answer("", [106, 0, 0], EOS) and empty_answer(" \n", [7, 106], EOS)
    assert not empty_answer("", [7, 8, 9], EOS)  # no end of turn yet (a thought channel, say)
    assert not empty_answer("Yea", [7, 106], EOS)


# -- through the generation loop: a scripted decoder, the real sampler and stopping rule ----------

C, V = 16, 512


class ScriptedBlocks:
    """A decoder whose every denoising attempt of a block follows the next entry of ``script``: a
    canvas (confident logits for it: the block converges in 2 steps) or None (flat logits: it
    never converges and its mean entropy is log V). Records what the encoder commits."""

    group = None
    activation_dtype = mx.float32

    def __init__(self, script):
        self.args = layerless_args(C, V)
        self.script, self.current, self.committed = list(script), None, []

    def make_cache(self):
        return KVCache(self.args)

    def prefill(self, ids, cache, dtype=None, chunk_size=None):
        self.committed.append(np.array(ids[0]).tolist())

    def prefill_chunks(self, ids, cache, dtype=None, chunk_size=None):
        self.prefill(ids, cache)
        yield ids.shape[1]

    def denoise(self, canvas, cache, sc, dtype=None, sc_top_k=None):
        if sc is None:  # a new attempt
            self.current = self.script.pop(0)
        x = np.zeros((1, C, V), np.float32)
        if self.current is not None:
            x[:] = -30.0
            x[0, np.arange(C), self.current] = 30.0
        return mx.array(x)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load(tiny_model_dir).tokenizer


PROMPT = [2, 5, 6]


def canvas(ids):
    """A final block: its tokens (an end of turn among them), then the padding a model writes after it."""
    return (list(ids) + [PAD] * C)[:C]


def full(ids):
    """A block the answer goes on after: its tokens, then distinct filler tokens (none repeats)."""
    ids = list(ids)[:C]
    return ids + list(range(200, 200 + C - len(ids)))


def run(tok, script, **params):
    model = ScriptedBlocks(script)
    p = SamplerParams(max_denoising_steps=6, **{"max_new_tokens": 3 * C, **params})
    rt = Runtime(model, tok)
    # eager: a compiled step would replay the logits its trace saw, not the script's next ones
    rt.steps[step_key(p, mx.float32)] = StepFunction(model, p, compile=False)
    events = list(_run(rt, model.make_cache(), PROMPT, p, mx.float32, None, 0))
    return model, events


def words(tok, text):
    return tok.encode(text)


def test_a_loop_is_trimmed_the_answer_ends_and_nothing_of_it_is_committed(tok):
    first = full(words(tok, "And so"))
    looped = (words(tok, "that") + [300] * C)[:C]
    model, events = run(tok, [first, looped])
    done, blocks = events[-1], [e for e in events if isinstance(e, BlockEvent)]
    n = len(words(tok, "that"))
    assert done.finish_reason == "repetition" and blocks[-1].end == "repetition" and blocks[-1].finished
    assert list(blocks[-1].tokens) == looped[:n] and list(done.tokens) == first + looped[:n]
    assert model.committed == [PROMPT, first]  # block 2 and its loop never reach the cache
    assert len(blocks) == 2  # the third block is never denoised


def test_repetition_trim_0_keeps_the_loop(tok):
    looped = (words(tok, "that") + [300] * C)[:C]
    model, events = run(tok, [looped], repetition_trim=0, max_new_tokens=C)
    assert events[-1].finish_reason == "length" and list(events[-1].tokens) == looped


def test_a_trailing_duplicate_is_dropped(tok):
    once = words(tok, "Amen.")
    block = canvas(words(tok, "Amen. Amen.") + [TURN_END])
    model, events = run(tok, [block])
    done = events[-1]
    assert done.finish_reason == "duplicate" and done.text == "Amen." and list(done.tokens) == once
    assert [e for e in events if isinstance(e, BlockEvent)][-1].end == "duplicate"
    model, events = run(tok, [block], duplicate_drop=0)
    assert events[-1].finish_reason == "eos" and events[-1].text == "Amen. Amen."


def test_an_unconverged_block_is_re_rolled_once_with_a_new_key(tok):
    good = canvas(words(tok, "Yea, verily.") + [TURN_END])
    model, events = run(tok, [None, good])
    steps = [e for e in events if isinstance(e, StepEvent)]
    done = events[-1]
    assert [e.attempt for e in steps] == [1] * 6 + [2, 2]  # 6 steps in vain, then the re-roll converges
    assert done.finish_reason == "eos" and done.text == "Yea, verily." and done.steps == 8
    assert done.steps_per_block == (2,)


def test_twice_unconverged_ends_the_answer_before_the_block_uncommitted(tok):
    first = full(words(tok, "And so"))
    model, events = run(tok, [first, None, None])
    done, last = events[-1], [e for e in events if isinstance(e, BlockEvent)][-1]
    steps = [e for e in events if isinstance(e, StepEvent) and e.block == 2]
    assert [e.attempt for e in steps] == [1] * 6 + [2] * 6
    # the re-roll draws with a new key: on the same (flat) logits its renoised canvas differs
    assert not np.array_equal(steps[0].canvas, steps[6].canvas)
    assert done.finish_reason == "unconverged" and last.end == "unconverged" and last.tokens == ()
    assert last.finished and last.block == 2
    assert list(done.tokens) == first and done.steps_per_block == (2,) and done.steps == 2 + 6 + 6
    assert model.committed == [PROMPT, first]


def test_commit_entropy_0_commits_the_unconverged_block(tok):
    # (flat logits' argmax is token 0 everywhere: a loop, so the loop trim is off here too)
    model, events = run(tok, [None, None], commit_entropy=0.0, repetition_trim=0, max_new_tokens=2 * C)
    done = events[-1]
    assert done.finish_reason == "length" and len(done.tokens) == 2 * C and done.steps == 12
    assert len(model.committed) == 2  # the prompt and block 1: the guard is off


def test_an_empty_first_block_is_re_rolled(tok):
    empty = canvas([TURN_END])
    good = canvas(words(tok, "Yea.") + [TURN_END])
    model, events = run(tok, [empty, good])
    assert events[-1].text == "Yea." and events[-1].finish_reason == "eos"
    assert {e.attempt for e in events if isinstance(e, StepEvent)} == {1, 2}
    model, events = run(tok, [empty, empty, empty, good], empty_rerolls=2)
    assert events[-1].text == "" and events[-1].finish_reason == "eos"  # two re-rolls, then it stays empty
    model, events = run(tok, [empty, good], empty_rerolls=0)
    assert events[-1].text == ""


def test_only_the_first_block_is_re_rolled_when_empty(tok):
    first = full(words(tok, "And so"))
    model, events = run(tok, [first, canvas([TURN_END]), canvas(words(tok, "x"))])
    assert list(events[-1].tokens) == first + canvas([TURN_END]) and events[-1].finish_reason == "eos"
    assert model.script  # the third entry was never used


def test_where_no_guard_fires_the_answer_is_unchanged(tok):
    """Guards on (the defaults) or all off: the same events, token for token."""
    script = [full(words(tok, "And so")), canvas(words(tok, " it was.") + [TURN_END])]
    off = {name: 0 for name in GUARD_PARAMS.values()} | {"empty_rerolls": 0}
    _, on = run(tok, list(script))
    _, without = run(tok, list(script), **off)
    assert on[-1].tokens == without[-1].tokens and on[-1].finish_reason == without[-1].finish_reason == "eos"
    assert [e.draft.tolist() for e in on if isinstance(e, StepEvent)] == \
        [e.draft.tolist() for e in without if isinstance(e, StepEvent)]


def test_the_trace_keeps_the_attempt_that_counts():
    def step(i, attempt):
        z = np.zeros(4)
        return StepEvent(block=1, step=i, max_steps=6, canvas=z, draft=z, accepted=z.astype(bool), entropy=z,
                         mean_entropy=0.0, temperature=0.5, seconds=0.1, stopped=False, attempt=attempt)

    t = Trace()
    for ev in [step(1, 1), step(2, 1), step(3, 1), step(1, 2), step(2, 2)]:
        t.add(ev)
    assert [(e.step, e.attempt) for e in t.blocks[0]] == [(1, 2), (2, 2)]


# -- every front end ---------------------------------------------------------------------------

def test_every_guard_is_a_flag_a_server_field_and_a_setting():
    from mlx_dgemma import params
    from mlx_dgemma.cli import build_parser
    from mlx_dgemma.server.schemas import SAMPLER_FIELDS
    from mlx_dgemma.tui.screens.settings import FIELDS

    names = set(GUARD_PARAMS.values()) | {"empty_rerolls"}
    assert names <= {p.name for p in params.PARAMS}
    settings = {name for name, _, _ in FIELDS}
    for name in names:
        flag = params.flags()[name]
        assert getattr(build_parser().parse_args(["generate", "--demo", "--prompt", "hi", flag, "0"]), name) == 0
        assert name in SAMPLER_FIELDS and name in settings
        assert getattr(SamplerParams(), name) > 0  # on by default


def test_the_chat_app_says_why_a_guard_ended_the_answer():
    from mlx_dgemma.tui.widgets.status import finish_words

    for reason in ENDINGS:
        done = DoneEvent(text="", thinking="", tokens=(), finish_reason=reason, prompt_tokens=3, prefill_seconds=0.1,
                         prefill_tokens_per_second=30.0, steps=4, steps_per_block=(4,), seconds_per_step=0.1,
                         tokens_per_forward=1.0, generation_seconds=0.4, peak_memory_bytes=0)
        assert finish_words(done).startswith("ended: ") and finish_words(done) != reason


def test_server_maps_a_guard_to_an_openai_finish_reason():
    from mlx_dgemma.server.openai import GUARD_FINISH, Answer

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

        def encode(self, text):
            return [7]

    for end, want in GUARD_FINISH.items():
        a = Answer(Tok(), EOS, markers=(None, None))
        a.add((5, 6), "5 6", "", end)
        assert a.finished and a.finish_reason == want and a.finish_detail == end
    a = Answer(Tok(), EOS, markers=(None, None))
    a.add((5, 106), "5", "", None)
    assert a.finish_reason == "stop" and a.finish_detail is None
    assert set(GUARD_FINISH.values()) <= {"stop", "length"} and set(GUARD_FINISH) == set(ENDINGS)


# one step per block cannot converge (the stopping rule needs two equal canvases): with any
# commit_entropy above 0 the block is re-rolled, then the answer ends
UNCONVERGED = {"max_denoising_steps": 1, "commit_entropy": 1e-12}


def test_server_answer_ended_by_the_commit_guard(served):
    _, client = served
    body = {"messages": [{"role": "user", "content": "And Moses said"}], "seed": 0, **UNCONVERGED}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["finish_detail"] == "unconverged"
    assert choice["message"]["content"] == ""
    chunks = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    last = [c for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]][-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["finish_detail"] == "unconverged"
    r = client.post("/v1/chat/completions", json={**body, "commit_entropy": 0.0, "repetition_trim": 0})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and "finish_detail" not in choice and choice["message"]["content"]


def test_cli_says_which_guard_ended_the_answer_and_how_to_turn_it_off(capsys):
    from mlx_dgemma.cli import main

    args = ["generate", "--demo", "--prompt", "And Moses said", "--seed", "0", "--steps", "1",
            "--commit-entropy", "1e-12"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[unconverged] a block did not converge, twice: the answer ends there (--commit-entropy 0 turns this off)" \
        in err and "[done] unconverged;" in err
    assert main([*args[:-1], "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] != "unconverged"
