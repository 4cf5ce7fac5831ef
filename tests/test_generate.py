"""Generation end to end on the tiny model: CLI, streaming events, EOS, sessions, errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_dgemma import ChatSession, generate, load, stream_generate
from mlx_dgemma.cache import KVCache
from mlx_dgemma.chat_template import render_chat
from mlx_dgemma.cli import main
from mlx_dgemma.errors import ModelFilesError, ParameterError
from mlx_dgemma.events import BlockEvent, DoneEvent, PrefillEvent, StepEvent
from mlx_dgemma.generation import _run
from mlx_dgemma.runtime import Runtime
from mlx_dgemma.sampler import SamplerParams
from tests.model_fakes import layerless_args


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load(tiny_model_dir)


def cli_json(capsys, *args):
    assert main(["generate", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generates_reproducibly(tiny_model_dir, capsys):
    args = ("--model", tiny_model_dir, "--prompt", "Why is the sky blue?", "--seed", "3", "--steps", "6",
            "--max-tokens", "40")
    a = cli_json(capsys, *args)
    b = cli_json(capsys, *args)
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    assert len(a["tokens"]) in (32, 64)  # whole canvases: ceil(40 / 32) = 2 blocks unless EOS
    assert all(1 <= s <= 6 for s in a["steps_per_block"])
    assert a["finish_reason"] in ("eos", "length")
    c = cli_json(capsys, *args[:-4], "--seed", "4", "--steps", "6", "--max-tokens", "40")
    assert c["tokens"] != a["tokens"]


def test_cli_streams_text_and_summary(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--seed", "1", "--steps", "4",
                 "--max-tokens", "32", "--show-drafts"]) == 0
    out = capsys.readouterr()
    assert "[block 1 step  1]" in out.err and "[done]" in out.err and "s/step" in out.err


def test_stream_events(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    events = list(stream_generate(rt, "Hello", generation_config=rt.generation_config, seed=0,
                                  max_denoising_steps=5, max_new_tokens=64))
    assert isinstance(events[0], PrefillEvent) and isinstance(events[-1], DoneEvent)
    steps = [e for e in events if isinstance(e, StepEvent)]
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    done = events[-1]
    assert steps and blocks and len(blocks) <= 2
    C = model.args.canvas_length
    for e in steps:
        assert e.canvas.shape == e.draft.shape == e.accepted.shape == e.entropy.shape == (C,)
        assert not e.entropy.flags.writeable
        assert e.mean_entropy == pytest.approx(float(e.entropy.mean()), rel=1e-5)
        assert 0.4 < e.temperature <= 0.8 and e.seconds > 0
        with pytest.raises(AttributeError):
            e.step = 3  # frozen
    assert done.steps == len(steps) == sum(done.steps_per_block)
    valid = sum(1 for t in done.tokens if t != 0)
    assert done.tokens_per_forward == pytest.approx(valid / done.steps)
    assert done.prefill_tokens_per_second > 0 and done.seconds_per_step > 0
    assert blocks[-1].tokens == tuple(done.tokens[-C:])
    assert generate(rt, "Hello", generation_config=rt.generation_config, seed=0,
                    max_denoising_steps=5, max_new_tokens=64) == done.text


def test_compiled_step_matches_eager(loaded):
    from mlx_dgemma.step import StepFunction

    model = loaded.model
    p = SamplerParams(max_denoising_steps=8)
    cache = model.make_cache()
    model.prefill(mx.array([list(range(5, 45))], dtype=mx.int32), cache)
    C = model.args.canvas_length
    canvas = mx.array([list(range(100, 100 + C))], dtype=mx.int32)
    outs = []
    for compiled in (True, False):
        fn = StepFunction(model, p, compile=compiled)
        hist = fn.initial_history((1, C))
        a = fn(canvas, None, 0.8, mx.random.key(1), hist, cache)
        b = fn(a["canvas"], a["processed"], 0.7, mx.random.key(2), a["history"], cache)
        outs.append((a, b))
    (ca, cb), (ea, eb) = outs
    for k in ("canvas", "argmax", "accepted", "stop", "history"):
        assert np.array_equal(np.array(ca[k]), np.array(ea[k])), k
        assert np.array_equal(np.array(cb[k]), np.array(eb[k])), k
    np.testing.assert_allclose(np.array(cb["entropy"]), np.array(eb["entropy"]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(cb["processed"]), np.array(eb["processed"]), rtol=1e-4, atol=1e-4)


class EosModel:
    """A fake decoder that puts <turn|> at position 5 with full confidence (no layers: a real,
    empty cache)."""

    group = None
    activation_dtype = mx.float32

    def __init__(self, C=16, V=200):
        self.args = layerless_args(C, V)
        self.prefills = []

    def make_cache(self):
        return KVCache(self.args)

    def prefill(self, ids, cache, dtype=None):
        self.prefills.append(ids.shape[1])

    def prefill_chunks(self, ids, cache, dtype=None, chunk_size=None):
        self.prefill(ids, cache)
        yield ids.shape[1]

    def denoise(self, canvas, cache, sc, dtype=None, sc_top_k=None):
        C, V = self.args.canvas_length, self.args.vocab_size
        x = np.full((1, C, V), -30.0, np.float32)
        target = np.arange(C) + 110
        target[5] = 106
        x[0, np.arange(C), target] = 30.0
        return mx.array(x)


def test_eos_stops_and_pads(loaded):
    model = EosModel()
    p = SamplerParams(max_new_tokens=48, max_denoising_steps=8)
    events = list(_run(Runtime(model, loaded.tokenizer), model.make_cache(), [2, 5, 6], p, mx.float32, None, 0))
    done = events[-1]
    assert done.finish_reason == "eos"
    assert len(done.tokens) == 16  # one block, not three
    assert done.tokens[5] == 106 and all(t == 0 for t in done.tokens[6:])
    assert model.prefills == [3]  # the prompt only: nothing committed after the final block
    assert done.steps == 2  # stability threshold 1: two identical confident argmax canvases


def test_cancel(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    n = {"steps": 0}

    def cancel():
        n["steps"] += 1
        return n["steps"] >= 2

    done = list(stream_generate(rt, "Hi", generation_config=rt.generation_config, seed=0,
                                max_denoising_steps=10, cancel=cancel))[-1]
    assert done.finish_reason == "cancelled" and done.steps == 2 and done.tokens == ()


def test_session_prefills_only_new_tokens(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    session = ChatSession(rt)
    first = list(session.stream("Why is the sky blue?", seed=0, max_denoising_steps=4, max_new_tokens=32))
    n1 = first[0].tokens
    # the cache holds the conversation as a fresh render holds it: the user's turn and the answer
    assert session.cache.offset == len(session.history) > 0
    kept = list(session.history)
    second = list(session.stream("And the sunset?", seed=1, max_denoising_steps=4, max_new_tokens=32))
    n2 = second[0].tokens
    assert session.cached_tokens == len(kept) and n2 == second[-1].prompt_tokens
    assert n2 + len(kept) == len(tok.encode(render_chat(session.messages[:-1], tok.chat_template)))
    assert n2 < n1 + 16  # only the new turn was encoded, not the conversation
    assert session.history[:len(kept)] == kept
    session.reset()
    assert session.cache.offset == 0 and session.history == []


@pytest.mark.parametrize("kwargs,match", [
    ({"t_min": -1.0}, "t_min"),
    ({"t_max": 0.3}, "t_max"),
    ({"entropy_bound": 0.0}, "entropy_bound"),
    ({"max_denoising_steps": 0}, "max_denoising_steps"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stability_threshold": -1}, "stability_threshold"),
    ({"temperature": 1.0}, "unknown generation parameter"),
])
def test_invalid_parameters(loaded, kwargs, match):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    with pytest.raises(ParameterError, match=match):
        list(stream_generate(rt, "Hi", **kwargs))


def test_prompt_errors(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    with pytest.raises(ParameterError, match="prompt: empty"):
        list(stream_generate(rt, "   "))
    long_prompt = list(range(5, 200)) * 25  # 4875 tokens > the tiny model's 4096 context
    with pytest.raises(ParameterError, match="exceed the context of 4096"):
        list(stream_generate(rt, long_prompt))


def test_cli_errors_are_one_line(tiny_model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer_gguf.json").unlink()
    assert main(["generate", "--model", str(broken), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer_gguf.json is missing" in err[0] and str(broken) in err[0]
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--steps 0: must be an integer in [1, 10000]" in err and "max_denoising_steps" not in err
    with pytest.raises(ModelFilesError):
        load(tmp_path / "nothing-here")


@pytest.mark.parametrize("flags, expected", [
    (["--sc-top-k", "0"], "--sc-top-k 0: must be an integer >= 1 (leave it out"),
    (["--max-tokens", "0"], "--max-tokens 0: must be an integer in [1, "),
    (["--t-min", "0.9"], "--t-min 0.9: must be below the first-step temperature (0.8)"),
    (["--t-max", "0.3"], "--t-max 0.3: must be above the temperature floor (--t-min, 0.4)"),
    (["--entropy-bound", "0"], "--entropy-bound 0.0: must be a number in [1e-12, 1e9]"),
])
def test_cli_sampler_errors_name_the_flag_typed(tiny_model_dir, capsys, flags, expected):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1
    assert not any(name in err for name in ("sc_top_k", "max_new_tokens", "t_min", "t_max", "entropy_bound", "None"))


def test_generate_uses_the_models_generation_config_by_default(tiny_model_dir):
    rt = load(tiny_model_dir)
    rt = replace(rt, generation_config={**rt.generation_config, "max_denoising_steps": 1, "max_new_tokens": 64})
    events = list(stream_generate(rt, "Hello", seed=0))  # no generation_config passed
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps and all(e.max_steps == 1 and e.step == 1 for e in steps)
    assert len(events[-1].tokens) <= 64
    session = ChatSession(rt)
    assert session.params.max_denoising_steps == 1 and session.params.max_new_tokens == 64
    # an explicit config still wins over the model's
    explicit = [e for e in stream_generate(rt, "Hello", generation_config={"max_denoising_steps": 3},
                                           max_new_tokens=32, seed=0) if isinstance(e, StepEvent)]
    assert explicit[0].max_steps == 3


def test_answers_share_one_traced_step(tiny_model_dir, monkeypatch):
    """A second answer (chat turn, server request) reuses the first one's compiled step: the
    decoder is traced once per self-conditioning variant, not once per answer; a different
    traced sampler field or a new precision traces again; no finished answer's cache is kept."""
    from mlx_dgemma.precision import apply_precision, resolve_precision

    rt = load(tiny_model_dir, precision="exact")
    model = rt.model
    traces = []
    real = type(model).denoise
    monkeypatch.setattr(type(model), "denoise", lambda self, *a, **k: (traces.append(1), real(self, *a, **k))[1])
    run = dict(seed=0, max_denoising_steps=3, max_new_tokens=32)
    list(stream_generate(rt, "Hello", **run))
    first = len(traces)
    assert first == 2  # compiled: the body runs only while tracing (with and without self-conditioning)
    list(stream_generate(rt, "Another question", **{**run, "seed": 5}))
    assert len(traces) == first
    shared = rt.step(SamplerParams.from_config(rt.generation_config))
    assert len(rt.steps) == 1 and shared._cache is None
    list(stream_generate(rt, "Hello", entropy_bound=0.5, **run))
    assert len(traces) == first + 2
    fast = resolve_precision("fast", None)
    apply_precision(model, fast)
    rt = Runtime(model, rt.tokenizer, rt.generation_config, fast)  # new weights: a new runtime, no old steps
    list(stream_generate(rt, "Hello", **run))
    assert len(traces) == first + 4


# --------------------------------------------------------------------------- log-probabilities

def test_logprobs_are_the_committing_steps_from_recomputed_logits(monkeypatch):
    """On the trained demo: each committed token's log-probability (and the top k) is that of
    the block's stopping step, log_softmax(logits) (temperature 1, whatever that step's), with the logits
    recomputed here by the model from the step's inputs (the canvas and self-conditioning logits
    the step function was given, the cache rebuilt from the prompt and earlier blocks). Asking
    for them changes nothing else."""
    from mlx_dgemma import load_demo
    from mlx_dgemma.step import StepFunction

    rt = load_demo()
    model, tok = rt.model, rt.tokenizer
    C = model.args.canvas_length
    ids = tok.encode(render_chat([{"role": "user", "content": "And God said"}], tok.chat_template))
    # a schedule (2.0 -> 0.5) whose temperature is never 1, so the tempered and the model's distributions differ
    # (5 steps at these temperatures leave blocks uncertain and looping: the answer guards, which
    # would re-roll or trim them and end the answer, are off, so every block is committed whole)
    kw = dict(seed=5, max_denoising_steps=5, max_new_tokens=2 * C, t_min=0.5, t_max=2.0, commit_entropy=0.0,
              repetition_trim=0, duplicate_drop=0)
    plain = list(stream_generate(rt, ids, **kw))

    calls: list[tuple] = []  # what each step was given: canvas, self-conditioning logits, temperature
    original = StepFunction.__call__

    def spy(self, canvas, sc, temperature, key, history, cache, revealed=None, held=None):
        calls.append((np.array(canvas), None if sc is None else np.array(sc), temperature, self.dtype, self.sc_top_k))
        return original(self, canvas, sc, temperature, key, history, cache, revealed, held)

    monkeypatch.setattr(StepFunction, "__call__", spy)
    k = 4
    events = list(stream_generate(rt, ids, logprobs=k, **kw))
    monkeypatch.undo()
    steps = [e for e in events if isinstance(e, StepEvent)]
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    assert len(calls) == len(steps)
    # the same answer, steps and entropies with or without them; without, the events carry none
    assert events[-1].tokens == plain[-1].tokens
    assert [s.entropy.tolist() for s in steps] == [e.entropy.tolist() for e in plain if isinstance(e, StepEvent)]
    assert all(b.logprobs is None and b.top_ids is None for b in plain if isinstance(b, BlockEvent))

    earlier: list[int] = []
    for b in blocks:
        i = max(j for j, s in enumerate(steps) if s.block == b.block)  # the block's stopping step
        canvas, sc, temp, dtype, sc_top_k = calls[i]
        assert temp == pytest.approx(steps[i].temperature)
        cache = model.make_cache()
        model.prefill(mx.array([ids + earlier]), cache)
        logits = model.denoise(mx.array(canvas), cache, None if sc is None else mx.array(sc), dtype=dtype,
                               sc_top_k=sc_top_k)
        x = np.array(logits[0].astype(mx.float32), dtype=np.float64)  # the model's distribution, not tempered
        logp = x - x.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        n = len(b.logprobs)
        gen = list(b.tokens[:n])
        eos = SamplerParams.from_config(rt.generation_config).eos_token_id
        end = next(j + 1 for j, t in enumerate(b.tokens) if t in eos) if b.finished else C
        assert n == end and b.top_ids.shape == b.top_logprobs.shape == (n, k)
        assert gen == logp[:n].argmax(-1).tolist()  # the committed tokens are that step's argmax
        np.testing.assert_allclose(b.logprobs, logp[np.arange(n), gen], atol=2e-3)
        expect = np.sort(logp[:n], axis=-1)[:, ::-1][:, :k]
        np.testing.assert_allclose(b.top_logprobs, expect, atol=2e-3)
        np.testing.assert_allclose(np.take_along_axis(logp[:n], b.top_ids.astype(np.int64), -1), b.top_logprobs,
                                   atol=2e-3)
        assert (b.top_logprobs[:, 0] >= b.logprobs - 1e-6).all() and (np.diff(b.top_logprobs, axis=-1) <= 0).all()
        earlier += list(b.tokens)
    # not all certain, so that the comparison can tell the tokens' logprobs apart
    assert any(b.logprobs.min() < -0.1 for b in blocks) and any(b.top_logprobs[:, 1].max() > -10 for b in blocks)


@pytest.mark.parametrize("bad", [-1, True, 1.5, 10**9])
def test_logprobs_out_of_range_is_a_parameter_error(loaded, bad):
    with pytest.raises(ParameterError, match="logprobs"):
        list(stream_generate(loaded, "Hi", logprobs=bad, max_new_tokens=8))


def test_a_raw_prompt_keeps_the_continuation_s_whitespace():
    """``chat=False`` continues the text: the answer is what the tokens spell up to the EOS,
    leading space included ("And God said" + " Jesus..."), not stripped like a chat answer."""
    from mlx_dgemma import load_demo
    from mlx_dgemma.chat_template import strip_specials

    rt = load_demo()
    events = list(stream_generate(rt, "And God said", chat=False, seed=0, max_denoising_steps=4, max_new_tokens=64))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    eos = SamplerParams.from_config(rt.generation_config).eos_token_id
    ids = list(done.tokens)
    ids = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]
    spelled = strip_specials(rt.tokenizer.decode(ids))
    assert spelled[:1].isspace()  # else this test checks nothing
    assert done.text == spelled
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    assert blocks[-1].text == done.text
