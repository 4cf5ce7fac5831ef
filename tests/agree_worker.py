"""Run by tests/test_distributed.py under ``mlx.launch -n 2 --backend ring``: a check that fails
on rank 1 alone (its memory), which must stop every rank together instead of leaving one in a
collective the other never joins.

``agree_worker.py load ARGS...``: rank 1's model load fails (as a memory plan refusing on the
smaller of two Macs would); the command line ``mlx-dgemma ARGS`` runs on both ranks.
``agree_worker.py fits OUT``: rank 1's memory check of a prompt fails once; rank 0 leads two
generations through ``ModelRuntime`` (rank 1 follows), and writes what it saw to OUT.
"""

from __future__ import annotations

import json
import sys

from mlx_dgemma import distributed
from mlx_dgemma.errors import DGemmaError, MemoryBudgetError

PARAMS = {"seed": 4, "max_new_tokens": 64, "max_denoising_steps": 4}
PROMPT = "Who was Moses?"
RANK = distributed.launched_rank()


def fail_once(message: str):
    calls = []

    def check(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryBudgetError(message)
    return check


def fits(out: str) -> None:
    import mlx_dgemma.generation as generation
    from mlx_dgemma.events import DoneEvent
    from mlx_dgemma.loader import open_model
    from mlx_dgemma.lockstep import ModelRuntime
    from mlx_dgemma.request import GenerationRequest

    if RANK == 1:
        generation.check_fits = fail_once("this prompt needs 9.0 GB but 4.0 GB is available on rank 1's Mac")
    rt = ModelRuntime(open_model(None, True, "auto", None))
    if not rt.leader:
        rt.follow()
        return
    seen: dict = {}
    try:
        for _ in rt.generate(PROMPT, GenerationRequest.of(PARAMS)):
            pass
    except DGemmaError as e:
        seen["error"] = [type(e).__name__, str(e)]
    seen["text"] = [ev.text for ev in rt.generate(PROMPT, GenerationRequest.of(PARAMS)) if isinstance(ev, DoneEvent)]
    rt.shutdown()
    with open(out, "w") as f:
        json.dump(seen, f)


def load(argv: list[str]) -> int:
    import mlx_dgemma.loader as loader
    from mlx_dgemma.cli import main

    if RANK == 1:
        def refuse(*args, **kwargs):
            raise MemoryBudgetError("the model needs 9.0 GB but 4.0 GB is available on rank 1's Mac")
        loader.load_demo = refuse  # what open_model calls for --demo
    return main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "fits":
        fits(sys.argv[2])
    else:
        sys.exit(load(sys.argv[2:]))
