"""Canvas templates (issue 31): positions of the answer fixed to given tokens and held by the
denoiser at every step, the rest denoised; the default path untouched."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_dgemma.canvas import CanvasTemplate
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.events import BlockEvent, DoneEvent, StepEvent


@pytest.fixture(scope="module")
def demo():
    from mlx_dgemma import load_demo

    return load_demo()


# the answer guards off: they end or re-roll the few-step blocks these tests run (what is tested
# is the template, and the guards act after the step, on what is committed)
GUARDS_OFF = {"commit_entropy": 0, "repetition_trim": 0, "duplicate_drop": 0, "empty_rerolls": 0}


def run(rt, **kw):
    from mlx_dgemma.generation import stream_generate

    return list(stream_generate(rt, "Who made the earth?", seed=3, max_denoising_steps=3, **GUARDS_OFF, **kw))


def test_fixed_positions_are_held_at_every_step_and_committed(demo):
    C = demo.model.args.canvas_length
    # a piece at the start, one in the middle of block 1, one in block 2 (a never-stopping rule
    # so that block 1 has no EOS and block 2 runs)
    t = CanvasTemplate.from_pieces(demo.tokenizer, ["And the LORD", 20, " Moses", C, " Egypt"])
    assert t.end > C
    events = run(demo, template=t, max_new_tokens=2 * C, stability_threshold=10_000, eos_token_id=[demo.model.args.vocab_size - 1])
    steps = [e for e in events if isinstance(e, StepEvent)]
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    assert len(blocks) == 2 and {s.block for s in steps} == {1, 2}
    for s in steps:
        for pos, tok in t.block(s.block - 1, C):
            assert s.canvas[pos] == tok and s.draft[pos] == tok and s.accepted[pos] and s.entropy[pos] == 0
    answer = [tok for b in blocks for tok in b.tokens]
    assert all(answer[p] == tok for p, tok in t.fixed)
    assert blocks[0].text.startswith("And the LORD")


def test_no_template_is_the_default_path(demo):
    # the same seed with and without an empty template: the same tokens (the default step)
    plain = [e for e in run(demo) if isinstance(e, DoneEvent)][0]
    empty = [e for e in run(demo, template=[]) if isinstance(e, DoneEvent)][0]
    assert plain.tokens == empty.tokens


def test_the_text_form_and_its_errors():
    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    t = CanvasTemplate.parse("ab{{3}}c", Tok())
    assert t.fixed == ((0, 97), (1, 98), (5, 99)) and t.end == 6
    assert t.block(0, 4) == [(0, 97), (1, 98)] and t.block(1, 4) == [(1, 99)]
    assert CanvasTemplate.of(t.pairs()) == t
    with pytest.raises(ParameterError, match="fixes no token"):
        CanvasTemplate.parse("{{5}}", Tok(), "--canvas-template")
    with pytest.raises(ParameterError, match="beyond the answer's 4 positions"):
        t.check(1000, 4)
    with pytest.raises(ParameterError, match=r"token id 97 \(position 0\) is outside \[0, 50\)"):
        t.check(50, 64)
    with pytest.raises(ParameterError, match="distinct and in order"):
        CanvasTemplate(((3, 1), (3, 2)))
    with pytest.raises(ParameterError, match="pairs"):
        CanvasTemplate.of(5)


def test_the_command_line_takes_a_template(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "generate", "--demo", "--prompt", "Who?", "--seed", "0",
                        "--steps", "2", "--commit-entropy", "0", "--canvas-template", "And the LORD said{{3}}, Moses"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("And the LORD said") and ", Moses" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "generate", "--demo", "--prompt", "Who?",
                        "--max-tokens", "64", "--canvas-template", "{{70}}x"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "mlx-dgemma generate: error: --canvas-template: fixes position 70") and "Traceback" not in r.stderr
