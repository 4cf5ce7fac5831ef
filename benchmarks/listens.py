"""Does the demo listen to its prompt? Word overlap of its answers across prompts and seeds.

    python benchmarks/listens.py [--model FILE.gguf] [--prompts 6] [--seeds 3] [--set KEY=VALUE ...] [--json out.json]

Each of the first ``--prompts`` prompts of ``mlx-dgemma bench --e2e`` (``bench.e2e.PROMPTS``:
verses to continue and free questions, chosen before this benchmark existed) is answered with
seeds 0 .. ``--seeds``-1, with the file's own sampler defaults, as ``generate --demo --prompt P
--seed S`` answers it. Words are runs of ASCII letters, lowercased (``train_demo.WORD``, the
corpus-words metric's split); the overlap of two answers is the Jaccard index of their word sets.

* **across prompts, same seed**: mean over every pair of different prompts answered with the same
  seed. A model that ignores the prompt turns the same seed's noise into the same answer: high.
* **same prompt, across seeds**: mean over every pair of seeds of one prompt: how much an answer
  is fixed by its prompt rather than by its noise.

Also: how many prompts of one seed end with the same three words as another prompt of that seed,
the share of answer words that are corpus words (``train_demo.train_words``: the training
chapters' words), steps per block, and every answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import statistics
import time
from pathlib import Path

from mlx_dgemma import load
from mlx_dgemma.bench.e2e import PROMPTS
from mlx_dgemma.bench.report import machine
from mlx_dgemma.demo import demo_file
from mlx_dgemma.events import DoneEvent
from mlx_dgemma.generation import stream_generate

ROOT = Path(__file__).resolve().parents[1]


def train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    return td


def jaccard(a: set[str], b: set[str]) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets: two empty answers are the same answer)."""
    return len(a & b) / len(a | b) if a | b else 1.0


def ending(text: str, word: re.Pattern, n: int = 3) -> str:
    """The answer's last ``n`` words, lowercased ('' for an answer with fewer)."""
    ws = [w.lower() for w in word.findall(text)]
    return " ".join(ws[-n:]) if len(ws) >= n else ""


def overlap(answers: dict[tuple[int, int], str], word: re.Pattern) -> dict:
    """The two mean Jaccard figures and the shared last sentences, from answers[(prompt, seed)]."""
    sets = {k: {w.lower() for w in word.findall(v)} for k, v in answers.items()}
    prompts = sorted({p for p, _ in answers})
    seeds = sorted({s for _, s in answers})
    across = [jaccard(sets[(a, s)], sets[(b, s)]) for s in seeds for a, b in itertools.combinations(prompts, 2)]
    within = [jaccard(sets[(p, a)], sets[(p, b)]) for p in prompts for a, b in itertools.combinations(seeds, 2)]
    shared = {}
    for s in seeds:
        ends = [ending(answers[(p, s)], word) for p in prompts]
        shared[s] = sum(1 for e in ends if e and ends.count(e) > 1)
    return {"across_prompts_same_seed": statistics.fmean(across) if across else None,
            "same_prompt_across_seeds": statistics.fmean(within) if within else None,
            "pairs_across": len(across), "pairs_within": len(within),
            "prompts_sharing_last_words_per_seed": shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the trained demo)")
    ap.add_argument("--prompts", type=int, default=6, help=f"the first N of bench's {len(PROMPTS)} prompts")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a sampler override instead of the file's default (repeatable), e.g. t_max=0.15")
    ap.add_argument("--answers", type=Path, default=None,
                    help="recompute the overlap figures from the answers of an earlier --json (no generation)")
    args = ap.parse_args()
    if args.answers:
        td = train_demo()
        saved = json.loads(args.answers.read_text())
        answers = {(a["prompt"], a["seed"]): a["answer"] for a in saved["answers"]}
        print(json.dumps(overlap(answers, td.WORD), indent=1))
        return
    if not 2 <= args.prompts <= len(PROMPTS) or args.seeds < 2:
        ap.error(f"--prompts must be in [2, {len(PROMPTS)}] and --seeds at least 2")
    td = train_demo()
    words = td.train_words()
    overrides = {k: float(v) if "." in v or "e" in v else int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    path = args.model or demo_file()
    rt = load(path)
    answers, steps, n_words, n_known = {}, [], 0, 0
    t0 = time.perf_counter()
    for p, prompt in enumerate(PROMPTS[: args.prompts]):
        for s in range(args.seeds):
            done = [ev for ev in stream_generate(rt, prompt, seed=s, **overrides) if isinstance(ev, DoneEvent)][0]
            answers[(p, s)] = done.text
            steps += list(done.steps_per_block)
            ws = [w.lower() for w in td.WORD.findall(done.text)]
            n_words += len(ws)
            n_known += sum(w in words for w in ws)
            print(f"p{p} s{s} {list(done.steps_per_block)} {prompt!r} -> {done.text!r}", flush=True)
    res = {"model": str(path), "machine": machine(), "overrides": overrides, "seconds": round(time.perf_counter() - t0, 1),
           "prompts": list(PROMPTS[: args.prompts]), "seeds": list(range(args.seeds)),
           **overlap(answers, td.WORD),
           "corpus_words": n_known / n_words if n_words else None, "words": n_words,
           "median_steps_per_block": statistics.median(steps), "mean_steps_per_block": statistics.fmean(steps),
           "answers": [{"prompt": p, "seed": s, "answer": a} for (p, s), a in answers.items()]}
    print(f"\nmean word overlap (Jaccard), different prompts, same seed: {res['across_prompts_same_seed']:.3f} "
          f"({res['pairs_across']} pairs)")
    print(f"mean word overlap (Jaccard), same prompt, different seeds: {res['same_prompt_across_seeds']:.3f} "
          f"({res['pairs_within']} pairs)")
    print(f"prompts whose last three words another prompt of the same seed ends with, per seed: "
          f"{res['prompts_sharing_last_words_per_seed']}")
    print(f"corpus words: {res['corpus_words']:.1%} ({n_known}/{n_words}); steps per block: median "
          f"{res['median_steps_per_block']}, mean {res['mean_steps_per_block']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
