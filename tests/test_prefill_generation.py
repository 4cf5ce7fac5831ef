"""Long prompts through stream_generate / ChatSession: progress events, cancelling between
chunks, refusal up front (context, memory), and the memory estimate against real caches."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_dgemma import ChatSession, load, stream_generate
from mlx_dgemma import memory
from mlx_dgemma.errors import MemoryBudgetError, ParameterError
from mlx_dgemma.events import DoneEvent, PrefillEvent, PrefillProgressEvent, StepEvent


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load(tiny_model_dir)


def _ids(model, n: int) -> list[int]:
    return [5 + i % (model.args.vocab_size - 10) for i in range(n)]


def test_progress_events_then_prefill_event(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    events = list(stream_generate(rt, _ids(model, 100), generation_config=rt.generation_config, seed=0,
                                  max_denoising_steps=2, max_new_tokens=8, prefill_chunk_size=32))
    progress = [e for e in events if isinstance(e, PrefillProgressEvent)]
    assert [(e.tokens_done, e.tokens_total) for e in progress] == [(32, 100), (64, 100), (96, 100), (100, 100)]
    assert all(a.seconds <= b.seconds for a, b in zip(progress, progress[1:]))
    first_other = next(i for i, e in enumerate(events) if not isinstance(e, PrefillProgressEvent))
    assert isinstance(events[first_other], PrefillEvent) and events[first_other].tokens == 100
    assert isinstance(events[-1], DoneEvent) and events[-1].prompt_tokens == 100


def test_chunk_size_does_not_change_the_answer(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    kw = dict(generation_config=rt.generation_config, seed=4, max_denoising_steps=3, max_new_tokens=40)
    a = [e for e in stream_generate(rt, _ids(model, 70), prefill_chunk_size=None, **kw)][-1]
    b = [e for e in stream_generate(rt, _ids(model, 70), prefill_chunk_size=9, **kw)][-1]
    assert a.tokens == b.tokens


def test_cancel_between_chunks_stops_before_denoising(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    seen = []
    events = []
    for ev in stream_generate(rt, _ids(model, 100), generation_config=rt.generation_config, seed=0,
                              prefill_chunk_size=25, cancel=lambda: bool(seen)):
        events.append(ev)
        if isinstance(ev, PrefillProgressEvent):
            seen.append(ev.tokens_done)
    assert seen == [25]  # polled after the first chunk
    assert not any(isinstance(e, (PrefillEvent, StepEvent)) for e in events)
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled" and not events[-1].tokens


def test_chat_session_recovers_after_a_stopped_prefill(loaded):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    s = ChatSession(rt)
    s.prefill_chunk_size = 8
    long_text = "tell me " * 30
    for ev in s.stream(long_text, seed=0, max_denoising_steps=2, max_new_tokens=8):
        if isinstance(ev, PrefillProgressEvent):
            break  # the consumer stops iterating after one chunk
    assert s.cache.offset == 8 and s.history == [] and s.messages == []
    done = [e for e in s.stream("Hi", seed=0, max_denoising_steps=2, max_new_tokens=8)][-1]
    assert isinstance(done, DoneEvent)
    assert s.cache.offset == len(s.history)  # the cache was rebuilt to match the conversation
    fresh = ChatSession(rt)
    assert [e for e in fresh.stream("Hi", seed=0, max_denoising_steps=2, max_new_tokens=8)][-1].tokens == done.tokens


def test_prompt_beyond_context_is_refused_up_front(loaded, monkeypatch):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    calls = []
    monkeypatch.setattr(model, "prefill_chunks", lambda *a, **k: calls.append(1) or iter(()))
    limit = model.args.max_position_embeddings
    with pytest.raises(ParameterError, match="exceed the context"):
        next(stream_generate(rt, _ids(model, limit), generation_config=rt.generation_config))
    assert not calls


def test_memory_refusal_is_one_line_and_before_any_work(loaded, monkeypatch):
    rt = loaded
    model, tok = rt.model, rt.tokenizer
    calls = []
    monkeypatch.setattr(model, "prefill_chunks", lambda *a, **k: calls.append(1) or iter(()))
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryBudgetError) as e:
        next(stream_generate(rt, _ids(model, 2000), generation_config=rt.generation_config))
    msg = str(e.value)
    assert "\n" not in msg and "2000 tokens" in msg and "1 MB is available" in msg and "shorten the prompt" in msg
    assert not calls


def test_estimate_matches_the_real_cache_and_grows_linearly(loaded):
    model = loaded.model
    a = model.args
    for n in (10, 300, 1500):
        cache = model.make_cache()
        model.prefill(mx.array([_ids(model, n)]), cache, chunk_size=256)
        assert memory.kv_cache_bytes(a, n) == cache.nbytes
    w = [memory.prefill_working_bytes(a, n, 256) for n in (4096, 8192, 16384, 32768)]
    steps = [b - c for b, c in zip(w[1:], w)]
    assert all(s > 0 for s in steps) and steps[2] <= 4.5 * steps[0]  # linear in the context, not quadratic


def test_cli_refuses_with_one_line_and_exit_code(tiny_model_dir, monkeypatch, capsys):
    from mlx_dgemma.cli import main

    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "word " * 500, "--seed", "0"])
    err = capsys.readouterr().err.strip()
    assert code == MemoryBudgetError.exit_code != 0
    assert len(err.splitlines()) == 1 and "is available" in err and "Traceback" not in err


def test_prefill_benchmark_runs_and_reports(tmp_path, capsys):
    """benchmarks/prefill.py end to end on `tiny` (ours only, fresh process): table and JSON."""
    import json

    from tests.scripts import load_script

    bench = load_script("benchmarks/prefill.py")
    out = tmp_path / "p.json"
    assert bench.main(["--config", "tiny", "--lengths", "96", "--chunks", "32", "--impls", "ours",
                       "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["tokens"] == 96 and row["tokens_per_second"] > 0
    assert row["peak_bytes"] >= row["kv_bytes"] + row["weights_bytes"] > 0
    assert row["kv_bytes"] == row["estimated_kv_bytes"]
    assert "peak/(KV+W)" in capsys.readouterr().out
