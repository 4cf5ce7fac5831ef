"""The speed/quality dial and sparse self-conditioning, measured on trained weights (the demo).

    python benchmarks/dial.py dial [--prompts 8] [--json dial.json]
    python benchmarks/dial.py sc   [--prompts 8] [--ks 32,64,256] [--json sc.json]

``dial``: each setting against the default (the file's EntropyBound sampler, 48 steps), same
prompts and seeds, settings interleaved prompt by prompt (so a load change on the shared machine
hits all of them alike): answer tokens/s (answer tokens = up to the end of the turn, see
``mlx_dgemma.bench.e2e``), steps per block, agreement with the default's answer (token-level
match ratio: equal tokens at equal positions / the longer answer's length; identical answers),
and the corpus-word share (words that are words of the demo's training chapters, counted as
``scripts/train_demo.py evaluate`` counts them; needs Debian's ``bible-kjv-text``).

``sc``: sparse self-conditioning (``sc_top_k``) against exact on the states a real generation
visits: along each prompt's default (exact) run, every step that has a self-conditioning input
is repeated with top-k self-conditioning on the same canvas, cache and input; reported: top-1
agreement of the logits at confident positions (the exact step's temperature-scaled top
probability >= 0.5) and at all positions, and the max relative logit error. Plus whole answers
with ``sc_top_k=k`` against exact ones (same seed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dgemma import load
from mlx_dgemma.bench.e2e import PROMPTS, WARMUP_PROMPT, _answer_tokens, _prompt_ids
from mlx_dgemma.bench.report import machine
from mlx_dgemma.demo import demo_file
from mlx_dgemma.events import DoneEvent, PrefillEvent
from mlx_dgemma.generation import stream_generate
from mlx_dgemma.params import QUALITIES
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.sampler import SamplerParams, temperature
from mlx_dgemma.step import StepFunction

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "default (EntropyBound, 48 steps)": {},
    "step cap 16": {"max_denoising_steps": 16},
    "step cap 8": {"max_denoising_steps": 8},
    "step cap 4": {"max_denoising_steps": 4},
    "confidence 0.9": {"accept_probability": 0.9},
    "confidence 0.7": {"accept_probability": 0.7},
    # the stopping rule (issue 33 item 2): stable argmax for k steps AND mean entropy below the
    # confidence threshold (the file's: 0.005); looser thresholds stop blocks sooner
    "stop entropy 0.02": {"confidence_threshold": 0.02},
    "stop entropy 0.05": {"confidence_threshold": 0.05},
    "stop entropy 0.05, stable 1": {"confidence_threshold": 0.05, "stability_threshold": 1},
    "stop entropy 0.05 only": {"confidence_threshold": 0.05, "stability_threshold": 0},
    # the dial's named settings (mlx_dgemma.params.QUALITIES; max is the default row)
    **{f"quality {q.name}": GenerationRequest.of(quality=q.name).params for q in QUALITIES if q.name != "max"},
}


def corpus_words() -> set[str] | None:
    """The demo's corpus word list (training chapters only), as ``train_demo.py prepare`` builds it."""
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    try:
        verses = td.read_kjv()
    except SystemExit:  # the `bible` program is missing
        return None
    chapters: dict = {}
    for book, ch, text in verses:
        chapters.setdefault((book, ch), []).append(text)
    keys = list(chapters)  # the held-out split of prepare(): every 37th chapter
    held = {k for i, k in enumerate(keys) if i % td.HELD_OUT_EVERY == td.HELD_OUT_EVERY // 2}
    return {w.lower() for k in keys if k not in held for t in chapters[k] for w in td.WORD.findall(t)}


def word_share(texts: list[str], words: set[str] | None) -> tuple[int, int]:
    import re

    ws = [w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)]  # train_demo.WORD
    return (sum(w in words for w in ws) if words is not None else -1), len(ws)


def one(rt, text: str, seed: int, overrides: dict) -> dict:
    tok = rt.tokenizer
    eos = SamplerParams.from_config(rt.generation_config, **overrides).eos_token_id
    t0 = time.perf_counter()
    done = prefill = None
    for ev in stream_generate(rt, _prompt_ids(tok, text), seed=seed, **overrides):
        if isinstance(ev, PrefillEvent):
            prefill = ev.seconds
        if isinstance(ev, DoneEvent):
            done = ev
    wall = time.perf_counter() - t0
    ids = _answer_tokens(list(done.tokens), eos)
    # the text as the user reads it (done.text: padding a block wrote mid-answer is not text; decoded
    # raw, each pad was a "<pad>" word that counted against the corpus-word share)
    return {"ids": ids, "text": done.text, "wall_s": wall, "prefill_s": prefill,
            "steps_per_block": list(done.steps_per_block)}


def match_ratio(a: list[int], b: list[int]) -> tuple[int, int]:
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def dial(args: argparse.Namespace) -> dict:
    rt = load(args.model or demo_file())
    words = corpus_words()
    prompts = list(PROMPTS[: args.prompts])
    settings = {k: v for k, v in SETTINGS.items() if not args.only or k in args.only.split(";")}
    for ov in settings.values():  # trace each setting's step once, untimed
        one(rt, WARMUP_PROMPT, 0, ov)
    runs: dict[str, list[dict]] = {k: [] for k in settings}
    for i, text in enumerate(prompts):
        for name, ov in settings.items():
            r = one(rt, text, i, ov)
            runs[name].append(r)
            print(f"[dial] {i} {name}: {len(r['ids'])} tok, steps {r['steps_per_block']}, {r['wall_s']:.1f} s: "
                  f"{r['text'][:60]!r}", file=sys.stderr, flush=True)
    base = runs[next(iter(settings))]
    rows = {}
    for name, rs in runs.items():
        ans = sum(len(r["ids"]) for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        blocks = [s for r in rs for s in r["steps_per_block"]]
        same = [match_ratio(r["ids"], b["ids"]) for r, b in zip(rs, base)]
        known, n_words = word_share([r["text"] for r in rs], words)
        rows[name] = {"overrides": settings[name], "answer_tokens": ans, "wall_s": wall,
                      "answer_tokens_per_s": ans / wall, "mean_steps_per_block": statistics.mean(blocks),
                      "median_steps_per_block": statistics.median(blocks),
                      "token_match_vs_default": sum(s for s, _ in same) / max(1, sum(n for _, n in same)),
                      "identical_answers": sum(r["ids"] == b["ids"] for r, b in zip(rs, base)),
                      "corpus_words": known, "words": n_words,
                      "corpus_word_share": known / n_words if words is not None and n_words else None,
                      "answers": [r["text"] for r in rs]}
    return {"machine": machine(), "model": str(args.model or demo_file()), "precision": rt.precision.label,
            "prompts": prompts, "rows": rows}


def dial_table(res: dict) -> str:
    lines = [f"{'setting':<34} {'ans tok/s':>9} {'speed':>6} {'steps/blk':>9} {'match':>6} {'same':>5} "
             f"{'corpus words':>16}"]
    base = next(iter(res["rows"].values()))["answer_tokens_per_s"]
    n = len(res["prompts"])
    for name, r in res["rows"].items():
        cw = f"{r['corpus_word_share']:.1%} ({r['corpus_words']}/{r['words']})" if r["corpus_word_share"] is not None \
            else "n/a"
        lines.append(f"{name:<34} {r['answer_tokens_per_s']:>9.2f} {r['answer_tokens_per_s'] / base:>5.2f}x "
                     f"{r['mean_steps_per_block']:>9.1f} {r['token_match_vs_default']:>6.1%} "
                     f"{r['identical_answers']:>2}/{n:<2} {cw:>16}")
    return "\n".join(lines)


def sc(args: argparse.Namespace) -> dict:
    rt = load(demo_file())
    model, tok = rt.model, rt.tokenizer
    ks = [int(k) for k in args.ks.split(",")]
    p = SamplerParams.from_config(rt.generation_config)
    step_fn = rt.step(p)
    C, V = model.args.canvas_length, model.args.vocab_size
    stats = {k: {"conf_agree": 0, "conf_n": 0, "all_agree": 0, "all_n": 0, "max_rel_err": 0.0} for k in ks}
    t_exact, t_k = [], {k: [] for k in ks}
    for i, text in enumerate(PROMPTS[: args.prompts]):
        # the default run's first block, step by step as denoise_block runs it (exact self-conditioning)
        cache = model.make_cache()
        model.prefill(mx.array([_prompt_ids(tok, text)], dtype=mx.int32), cache)
        key = mx.random.key(i)
        key, k0 = mx.random.split(key)
        canvas = mx.random.randint(0, V, (1, C), key=k0).astype(mx.int32)
        history = step_fn.initial_history((1, C))
        sc_logits = None
        for left in range(p.max_denoising_steps, 0, -1):
            key, sub = mx.random.split(key)
            temp = temperature(left, p)
            if sc_logits is not None:
                t0 = time.perf_counter()
                exact = model.denoise(canvas, cache, sc_logits)
                mx.eval(exact)
                t_exact.append(time.perf_counter() - t0)
                conf = mx.max(mx.softmax(exact / temp, axis=-1), axis=-1) >= 0.5
                top = mx.argmax(exact, axis=-1)
                for k in ks:
                    t0 = time.perf_counter()
                    approx = model.denoise(canvas, cache, sc_logits, sc_top_k=k)
                    mx.eval(approx)
                    t_k[k].append(time.perf_counter() - t0)
                    agree = mx.argmax(approx, axis=-1) == top
                    s = stats[k]
                    s["conf_agree"] += int(mx.sum(agree & conf).item())
                    s["conf_n"] += int(mx.sum(conf).item())
                    s["all_agree"] += int(mx.sum(agree).item())
                    s["all_n"] += agree.size
                    s["max_rel_err"] = max(s["max_rel_err"],
                                           float((mx.abs(approx - exact).max() / mx.abs(exact).max()).item()))
            out = step_fn(canvas, sc_logits, temp, sub, history, cache)
            mx.eval(out["canvas"], out["processed"], out["history"], out["stop"])
            canvas, sc_logits, history = out["canvas"], out["processed"], out["history"]
            if bool(out["stop"][0].item()):
                break
        print(f"[sc] prompt {i}: {p.max_denoising_steps - left + 1} steps", file=sys.stderr, flush=True)
    # whole answers with top-k self-conditioning, same seeds
    words = corpus_words()
    answers = {}
    for k in [None] + ks:
        rs = [one(rt, text, i, {"sc_top_k": k} if k else {}) for i, text in enumerate(PROMPTS[: args.prompts])]
        answers[k] = rs
    rows = []
    for k in ks:
        s = stats[k]
        same = [match_ratio(a["ids"], b["ids"]) for a, b in zip(answers[k], answers[None])]
        known, n_words = word_share([r["text"] for r in answers[k]], words)
        rows.append({"sc_top_k": k, "confident_positions": s["conf_n"],
                     "top1_agreement_confident": s["conf_agree"] / max(1, s["conf_n"]),
                     "top1_agreement_all": s["all_agree"] / max(1, s["all_n"]), "positions": s["all_n"],
                     "max_rel_logit_error": s["max_rel_err"],
                     "median_decoder_pass_s": statistics.median(t_k[k]),
                     "answer_token_match": sum(a for a, _ in same) / max(1, sum(n for _, n in same)),
                     "identical_answers": sum(a["ids"] == b["ids"] for a, b in zip(answers[k], answers[None])),
                     "corpus_word_share": known / n_words if words is not None and n_words else None})
    known, n_words = word_share([r["text"] for r in answers[None]], words)
    return {"machine": machine(), "model": str(args.model or demo_file()), "precision": rt.precision.label,
            "vocab_size": V, "prompts": args.prompts, "exact_median_decoder_pass_s": statistics.median(t_exact),
            "exact_corpus_word_share": known / n_words if words is not None and n_words else None, "rows": rows}


def sc_table(res: dict) -> str:
    lines = [f"exact self-conditioning: decoder pass {res['exact_median_decoder_pass_s'] * 1e3:.0f} ms (median); "
             f"corpus words {res['exact_corpus_word_share']}",
             f"{'k':>5} {'top-1 @p>=0.5':>14} {'(positions)':>11} {'top-1 all':>9} {'max rel err':>11} "
             f"{'pass ms':>8} {'answer match':>12} {'same':>5} {'corpus words':>12}"]
    for r in res["rows"]:
        cw = f"{r['corpus_word_share']:.1%}" if r["corpus_word_share"] is not None else "n/a"
        lines.append(f"{r['sc_top_k']:>5} {r['top1_agreement_confident']:>14.2%} {r['confident_positions']:>11} "
                     f"{r['top1_agreement_all']:>9.2%} {r['max_rel_logit_error']:>11.2e} "
                     f"{r['median_decoder_pass_s'] * 1e3:>8.0f} {r['answer_token_match']:>12.1%} "
                     f"{r['identical_answers']:>2}/{res['prompts']:<2} {cw:>12}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("dial", "sc"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ks", default="32,64,256")
    ap.add_argument("--only", help="dial: ';'-separated setting names (the first is the reference)")
    ap.add_argument("--model", default=None,
                    help="dial: a .gguf or converted directory (default: the demo; e.g. its K-quant copy, "
                         "convert/kquant.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = dial(args) if args.what == "dial" else sc(args)
    res["machine"]["load_average"] = list(__import__("os").getloadavg())
    print(dial_table(res) if args.what == "dial" else sc_table(res))
    Path(args.json or f"{args.what}.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
