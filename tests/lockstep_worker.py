"""Run by tests/test_distributed.py under ``mlx.launch -n 2 --backend ring`` (and in-process for
the one-process reference): the chat app's job sequence through the core's ``ModelRuntime`` on
the demo model. Rank 0 leads (load, turns, a cancelled turn, a turn its consumer leaves early,
a new chat with a system prompt, shutdown); rank 1 runs the follower loop. Rank 0 writes what
it saw as JSON to ``argv[1]``."""

from __future__ import annotations

import json
import sys

from mlx_dgemma import distributed
from mlx_dgemma.events import DoneEvent, StepEvent
from mlx_dgemma.loader import open_model
from mlx_dgemma.lockstep import ModelRuntime
from mlx_dgemma.request import GenerationRequest

FAST = {"seed": 1, "max_new_tokens": 128, "max_denoising_steps": 4}


def turn(rt: ModelRuntime, text: str, cancel_after: int | None = None, leave_after: int | None = None,
         **params) -> dict:
    """One turn as the chat app's engine runs it; ``cancel_after`` steps: Escape (the cancel
    check says stop); ``leave_after`` steps: the consumer stops iterating."""
    steps = 0
    done = None
    events = rt.chat(text, GenerationRequest.of({**FAST, **params}),
                     cancel=lambda: cancel_after is not None and steps >= cancel_after, enable_thinking=False)
    for ev in events:
        if isinstance(ev, StepEvent):
            steps += 1
            if leave_after is not None and steps >= leave_after:
                events.close()
                break
        elif isinstance(ev, DoneEvent):
            done = ev
    return {"steps": steps, "reason": done.finish_reason if done else None, "text": done.text if done else None,
            "history": len(rt.session.history), "messages": len(rt.session.messages)}


def run() -> list[dict]:
    rt = ModelRuntime(open_model(None, True, "auto", None))  # as the chat app's backend loads it
    if not rt.leader:
        rt.follow()
        return []
    rt.new_chat(enable_thinking=False)
    out = [turn(rt, "Who was Moses?"),
           turn(rt, "And Aaron?", cancel_after=2),
           turn(rt, "And Aaron?", seed=2),
           turn(rt, "Tell me of Egypt.", leave_after=3)]
    rt.new_chat(enable_thinking=False, system="Answer in the words of the King James Bible.")
    out.append(turn(rt, "Who was Moses?", seed=3))
    out.append({"ranks": distributed.size_of(rt.runtime.group)})
    rt.shutdown()
    return out


if __name__ == "__main__":
    res = run()
    if distributed.launched_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f)
