"""One answer's figures (mlx_dgemma.events.Stats): folded from the events once, read by the
DoneEvent, the server's timings and the chat app's status line alike."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from mlx_dgemma.events import BlockEvent, DoneEvent, PrefillEvent, Stats, StepEvent

ANSWER = ("text", "thinking", "tokens", "finish_reason", "peak_memory_bytes", "precision")


def step(block: int, seconds: float) -> StepEvent:
    z = np.zeros(4, dtype=np.int32)
    return StepEvent(block=block, step=1, max_steps=8, canvas=z, draft=z, accepted=z.astype(bool),
                     entropy=z.astype(np.float32), mean_entropy=0.0, temperature=1.0, seconds=seconds, stopped=False)


def block(n: int, tokens: tuple[int, ...], steps: int, end: str | None = None) -> BlockEvent:
    return BlockEvent(block=n, tokens=tokens, steps=steps, finished=end is not None, text="", thinking="",
                      raw_text="", end=end)


def test_the_figures_fold_from_the_events():
    s = Stats(pad_id=0)
    for ev in (PrefillEvent(tokens=12, seconds=0.5), step(1, 0.25), step(1, 0.75), block(1, (5, 6, 7, 8), 2),
               step(2, 1.0), block(2, (), 1, end="unconverged")):  # the commit guard dropped block 2
        s.add(ev)
    done = s.done("hi", "", (5, 6, 7, 8), "unconverged", 123, "exact (float32)")
    assert (done.prompt_tokens, done.prefill_seconds, done.prefill_tokens_per_second) == (12, 0.5, 24.0)
    assert (done.steps, done.steps_per_block, done.seconds_per_step) == (3, (2,), 2.0 / 3)
    assert done.tokens_per_forward == 4 / 3
    assert done.generation_seconds > 0 and done.peak_memory_bytes == 123 and done.precision == "exact (float32)"
    padded = Stats(pad_id=0)
    padded.add(step(1, 0.1))
    padded.add(block(1, (5, 1, 0, 0), 1, end=None))
    assert padded.tokens_per_forward == 2.0  # padding after EOS is no answer token


def test_every_figure_of_the_done_event_is_a_stats_figure():
    """A figure added to DoneEvent and Stats (same name) reaches every DoneEvent built, the cancelled
    ones included, with no edit where they are built."""
    figures = [f.name for f in fields(DoneEvent) if f.name not in ANSWER]
    assert figures and all(hasattr(Stats(), name) for name in figures), figures


def test_a_cancelled_answer_reports_its_prompt_and_nothing_else():
    done = DoneEvent.cancelled(prompt_tokens=900, prefill_seconds=2.0, peak_memory_bytes=7, precision="fast")
    assert done == DoneEvent(text="", thinking="", tokens=(), finish_reason="cancelled", prompt_tokens=900,
                             prefill_seconds=2.0, prefill_tokens_per_second=0.0, steps=0, steps_per_block=(),
                             seconds_per_step=0.0, tokens_per_forward=0.0, generation_seconds=0.0,
                             peak_memory_bytes=7, precision="fast")


def test_a_consumers_figures_are_the_cores(tiny_model_dir):
    """What a front end folds from the events it reads is what the core's DoneEvent reports."""
    pytest.importorskip("mlx.core")
    from mlx_dgemma import load, stream_generate

    rt = load(tiny_model_dir)
    mine = Stats(pad_id=rt.generation_config.get("pad_token_id"))
    events = list(stream_generate(rt, "hi", max_new_tokens=3 * rt.model.args.canvas_length, seed=1,
                                  max_denoising_steps=4))
    for ev in events:
        mine.add(ev)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.steps > 0
    assert (done.prompt_tokens, done.steps, done.steps_per_block) == \
        (mine.prompt_tokens, mine.steps, tuple(mine.steps_per_block))
    assert (done.prefill_tokens_per_second, done.seconds_per_step, done.tokens_per_forward) == \
        (mine.prefill_tokens_per_second, mine.seconds_per_step, mine.tokens_per_forward)


def test_the_cli_summary_is_its_own_fold_of_the_events(monkeypatch, capsys):
    """`generate --json`'s figures come from its own Stats (a new statistic: its Stats property and
    the line that shows it, no DoneEvent field); they are the core DoneEvent's, which the spy keeps."""
    pytest.importorskip("mlx.core")
    import mlx_dgemma.generation as generation
    from mlx_dgemma.cli import main

    seen: list = []
    real = generation.stream_generate

    def spy(*a, **k):
        for ev in real(*a, **k):
            seen.append(ev)
            yield ev

    monkeypatch.setattr(generation, "stream_generate", spy)
    assert main(["generate", "--demo", "--prompt", "And God said", "--seed", "0", "--steps", "4",
                 "--max-tokens", "128", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    done = seen[-1]
    assert isinstance(done, DoneEvent) and done.steps > 0
    assert (out["prompt_tokens"], out["steps"], out["steps_per_block"]) == \
        (done.prompt_tokens, done.steps, list(done.steps_per_block))
    assert out["tokens_per_forward"] == round(done.tokens_per_forward, 3)
    assert out["seconds_per_step"] == round(done.seconds_per_step, 4)
