"""Run by tests/test_distributed.py under ``mlx.launch -n 2 --backend ring`` (and in-process for
the one-process reference): logits of the demo model after a multi-chunk prefill, with exact
and top-k self-conditioning, and a seeded generation. Rank 0 writes them to ``argv[2]``."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

from mlx_dgemma import distributed, generate, load

PROMPT = "And God said unto Moses, Let there be light upon the waters of the"
CHUNK = 4  # several prefill chunks (the multi-chunk prompt path, mlx #4342 under JACCL)


def full(logits: mx.array, group: mx.distributed.Group | None) -> np.ndarray:
    """The whole vocabulary's logits on every rank (each rank holds its own columns)."""
    if group is not None:
        logits = mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(logits, -1, 0), group=group), 0, -1)
    return np.array(logits)


def run(model_dir: str, text: bool = True, sc_input: np.ndarray | None = None) -> dict:
    """The logits (and with ``text``, a seeded generation's text) of the model in ``model_dir``.
    ``sc_input``: the first pass's logits that self-conditioning reads (default: this run's
    own), to compare the self-conditioned pass alone on the same input (one process only)."""
    rt = load(model_dir, precision="exact")
    model, tokenizer = rt.model, rt.tokenizer
    group = model.group
    ids = mx.array([tokenizer.encode(PROMPT)])
    cache = model.make_cache()
    model.prefill(ids, cache, chunk_size=CHUNK)
    canvas = mx.random.randint(0, model.args.vocab_size, (1, model.args.canvas_length),
                               key=mx.random.key(0)).astype(mx.int32)
    first = model.denoise(canvas, cache)
    out = {"first_own": full(first, group)}
    if sc_input is not None:
        first = mx.array(sc_input)
    out |= {"chunks": -(-ids.shape[1] // CHUNK), "ranks": distributed.size_of(group),
           "first": out.pop("first_own"), "sc": full(model.denoise(canvas, cache, first), group),
           "sc_top_k": full(model.denoise(canvas, cache, first, sc_top_k=8), group)}
    if not text:  # random weights (``medium``): chaotic, only the logits are compared
        return out
    out["text"] = generate(rt, PROMPT, seed=3, max_new_tokens=64, max_denoising_steps=16,
                           prefill_chunk_size=CHUNK)
    return out


if __name__ == "__main__":
    res = run(sys.argv[1], text="--no-text" not in sys.argv[3:])
    if distributed.launched_rank() == 0:
        np.savez(sys.argv[2], **{k: v for k, v in res.items() if isinstance(v, np.ndarray)})
        with open(sys.argv[2] + ".json", "w") as f:
            json.dump({k: v for k, v in res.items() if not isinstance(v, np.ndarray)}, f)
