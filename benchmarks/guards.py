"""The answer guards (``mlx_dgemma.guards``) measured on the trained demo.

    python benchmarks/guards.py corpus [--json corpus.json]
    python benchmarks/guards.py commit [--prompts 12] [--seeds 3] [--steps 48] [--json commit.json]
    python benchmarks/guards.py empty  [--prompts 12] [--seeds 5] [--json empty.json]

``corpus``: false positives of the repetition-loop trim and the trailing-duplicate drop on the
demo's corpus (the KJV, Debian's ``bible-kjv-text``, as ``scripts/train_demo.py`` reads it),
tokenized with the demo's tokenizer: the whole text in 64-token windows (the demo's canvas), and
each verse as the demo's training answers hold it (its tokens, then the end of turn).

``commit``: per block, with every guard off, whether the stopping rule was met and the last
step's mean entropy, on the trained demo (Q8_0) and its K-quant copy (Q4_K_M rule, our writer):
the distribution the commit guard's threshold is chosen from. Also the share of corpus words
of converged and unconverged blocks (what a re-roll or an early end saves the reader from).

``empty``: the empty-answer remedies on terse prompts (yes/no questions, one-word answers),
first block only, several seeds: (a) end of turn forbidden at the first canvas position of the
first canvas (its logits there masked before sampling, so the self-conditioning input the next
step reads is masked too); (b) re-roll an empty first block with a new key, at the canvas
length, and (b') at half and a quarter of it (the other port's 256 -> 128 -> 64, scaled to the
demo's 64). "Answered": the first block's visible text is not empty.
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
from mlx_dgemma.bench.report import machine
from mlx_dgemma.chat_template import parse_answer, render_chat
from mlx_dgemma.demo import demo_file
from mlx_dgemma.events import BlockEvent, StepEvent
from mlx_dgemma.generation import stream_generate
from mlx_dgemma.guards import duplicate_half, loop_start
from mlx_dgemma.sampler import SamplerParams, finalize_block, temperature
from mlx_dgemma.step import StepFunction

ROOT = Path(__file__).resolve().parents[1]
GUARDS_OFF = {"repetition_trim": 0, "duplicate_drop": 0, "commit_entropy": 0.0}

# chat prompts: the benchmark's (mlx_dgemma.bench.e2e.PROMPTS) and more of the same kinds
PROMPTS = ("In the beginning God created the heaven and the earth.", "The Lord is my shepherd",
           "Tell me about the sea.", "And the king said unto Daniel,", "Blessed are the meek:",
           "Who made the stars?", "And Moses went up unto the mountain.", "What is wisdom?",
           "And Jesus answered and said unto them,", "Sing unto the LORD a new song.",
           "What shall we eat?", "And it came to pass in those days,")
TERSE = ("Is the LORD good?", "Did Noah build an ark?", "Was Moses a prophet?", "Is the sea deep?",
         "Shall the meek inherit the earth?", "Is wisdom better than gold?",
         "Who built the ark?", "Who led Israel out of Egypt?", "Who slew Goliath?",
         "Where was Jesus born?", "What did God create first?", "Who was the first man?")


def train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    return td


def word_share(text: str, words: set[str], td) -> tuple[int, int]:
    ws = [w.lower() for w in td.WORD.findall(text)]
    return sum(w in words for w in ws), len(ws)


# ----------------------------------------------------------------------------- corpus

def corpus(args: argparse.Namespace) -> dict:
    td = train_demo()
    verses = [v for _, _, v in td.read_kjv()]
    rt = load(demo_file())
    tok = rt.tokenizer
    p = SamplerParams.from_config(rt.generation_config)
    C = rt.model.args.canvas_length
    ids = tok.encode(" ".join(verses))
    windows = [ids[i:i + C] for i in range(0, len(ids) - C + 1, C)]
    loops = [w for w in windows if loop_start(w, p.eos_token_id, p.repetition_trim) is not None]
    dups = [w for w in windows if duplicate_half(tok.decode(w), p.duplicate_drop) is not None]
    end = p.eos_token_id[1] if len(p.eos_token_id) > 1 else p.eos_token_id[0]  # <turn|>, as the training answers end
    v_loops = [v for v in verses if loop_start(tok.encode(v) + [end], p.eos_token_id, p.repetition_trim) is not None]
    v_dups = [v for v in verses if duplicate_half(v, p.duplicate_drop) is not None]
    # how close real text comes: the longest stride-1/2 run of one token in any window
    def longest(w):
        best = 0
        for stride in (1, 2):
            for i in range(len(w)):
                reps, j = 0, i
                while j + stride < len(w) and w[j] == w[j + stride]:
                    reps, j = reps + 1, j + stride
                best = max(best, reps)
        return best
    runs = [longest(w) for w in windows]
    return {"machine": machine(), "tokens": len(ids), "windows": len(windows), "verses": len(verses),
            "loop_windows": len(loops), "dup_windows": len(dups), "loop_verses": len(v_loops),
            "dup_verses": len(v_dups), "max_run_in_a_window": max(runs),
            "windows_with_run_ge": {k: sum(r >= k for r in runs) for k in range(1, 7)},
            "examples": {"loop_windows": [tok.decode(w) for w in loops[:5]],
                         "dup_windows": [tok.decode(w) for w in dups[:5]],
                         "loop_verses": v_loops[:5], "dup_verses": v_dups[:5]}}


# ----------------------------------------------------------------------------- commit

def commit(args: argparse.Namespace) -> dict:
    import tempfile

    from mlx_dgemma.convert.kquant import write_kquant_copy

    td = train_demo()
    words = td.train_words()
    tmp = Path(tempfile.mkdtemp())
    models = {"demo Q8_0": demo_file(), "demo K-quant (Q4_K_M rule)": write_kquant_copy(demo_file(), tmp / "kq.gguf")}
    out = {"machine": machine(), "steps": args.steps, "models": {}}
    for name, path in models.items():
        rt = load(path)
        blocks = []
        for i, text in enumerate(PROMPTS[: args.prompts]):
            for seed in range(args.seeds):
                last = None
                for ev in stream_generate(rt, text, seed=seed, max_new_tokens=args.max_tokens,
                                          max_denoising_steps=args.steps, **GUARDS_OFF):
                    if isinstance(ev, StepEvent):
                        last = ev
                    elif isinstance(ev, BlockEvent):
                        piece = rt.tokenizer.decode([t for t in ev.tokens if t != 0])
                        known, n = word_share(parse_answer(piece).answer, words, td)
                        blocks.append({"prompt": i, "seed": seed, "block": ev.block, "steps": ev.steps,
                                       "converged": last.stopped, "last_mean_entropy": last.mean_entropy,
                                       "corpus_words": known, "words": n, "text": piece})
                        print(f"[commit] {name} p{i} s{seed} b{ev.block}: {ev.steps} steps, "
                              f"{'converged' if last.stopped else 'UNCONVERGED'} H={last.mean_entropy:.4g} "
                              f"{piece[:50]!r}", file=sys.stderr, flush=True)
        out["models"][name] = summarize_blocks(blocks)
    return out


def summarize_blocks(blocks: list[dict]) -> dict:
    def dist(xs: list[float]) -> dict:
        if not xs:
            return {"n": 0}
        q = np.quantile(xs, [0, 0.1, 0.5, 0.9, 1]).tolist()
        return {"n": len(xs), "min": q[0], "p10": q[1], "median": q[2], "p90": q[3], "max": q[4]}

    conv = [b for b in blocks if b["converged"]]
    unconv = [b for b in blocks if not b["converged"]]

    def share(bs):
        n = sum(b["words"] for b in bs)
        return sum(b["corpus_words"] for b in bs) / n if n else None

    return {"blocks": blocks, "converged": dist([b["last_mean_entropy"] for b in conv]),
            "unconverged": dist([b["last_mean_entropy"] for b in unconv]),
            "corpus_word_share": {"converged": share(conv), "unconverged": share(unconv)}}


# ----------------------------------------------------------------------------- empty

class EndBannedAtFirst:
    """The model with the end-of-turn ids' logits pushed far down at the canvas' first position
    (remedy a). Masked before the sampler, so the temperature-scaled logits the next step
    self-conditions on are masked alike. Finite (not -inf): the step's finiteness check stays."""

    def __init__(self, model, eos_ids: tuple[int, ...], length: int):
        self.model, self.args, self.group = model, model.args, model.group
        bias = np.zeros((1, length, model.args.vocab_size), np.float32)
        bias[0, 0, list(eos_ids)] = -1e4
        self.bias = mx.array(bias)

    def denoise(self, canvas, cache, sc=None, dtype=None, sc_top_k=None):
        return self.model.denoise(canvas, cache, sc, dtype=dtype, sc_top_k=sc_top_k) + self.bias


def first_block(step_fn: StepFunction, cache, p: SamplerParams, key: mx.array, length: int) -> tuple[list[int], int]:
    """denoise_block's loop at canvas ``length`` (the model's, or shorter): the argmax block and its steps."""
    V = step_fn.model.args.vocab_size
    key, k0 = mx.random.split(key)
    canvas = mx.random.randint(0, V, (1, length), key=k0).astype(mx.int32)
    history = step_fn.initial_history((1, length))
    sc, revealed, argmax = None, None, canvas
    N = p.max_denoising_steps
    for i, left in enumerate(range(N, 0, -1), start=1):
        key, sub = mx.random.split(key)
        out = step_fn(canvas, sc, temperature(left, p), sub, history, cache, revealed)
        mx.eval(out["argmax"], out["stop"])
        canvas, argmax, sc, history, revealed = out["canvas"], out["argmax"], out["processed"], out["history"], \
            out["revealed"]
        if bool(out["stop"][0].item()):
            break
    return np.array(argmax[0]).tolist(), i


def empty(args: argparse.Namespace) -> dict:
    td = train_demo()
    words = td.train_words()
    rt = load(demo_file())
    model, tok = rt.model, rt.tokenizer
    p = SamplerParams.from_config(rt.generation_config)
    C = model.args.canvas_length
    dtype = rt.activation_dtype
    plain = {n: StepFunction(model, p, dtype, precision_sc_top_k=rt.precision.sc_top_k) for n in (C, C // 2, C // 4)}
    banned = StepFunction(EndBannedAtFirst(model, p.eos_token_id, C), p, dtype, precision_sc_top_k=rt.precision.sc_top_k)

    def answer(block: list[int]) -> str:
        kept, _ = finalize_block(block, p.eos_token_id, p.pad_token_id)
        return parse_answer(tok.decode([t for t in kept if t != p.pad_token_id])).answer

    rows = []
    for i, text in enumerate(TERSE[: args.prompts]):
        ids = tok.encode(render_chat([{"role": "user", "content": text}], tok.chat_template))
        cache = model.make_cache()
        model.prefill(mx.array([ids], dtype=mx.int32), cache, dtype=dtype)
        for seed in range(args.seeds):
            _, sub = mx.random.split(mx.random.key(seed))  # the first block's key, as generation derives it
            base, steps = first_block(plain[C], cache, p, sub, C)
            row = {"prompt": text, "seed": seed, "base": answer(base), "base_steps": steps}
            ban, steps = first_block(banned, cache, p, sub, C)
            row.update(ban=answer(ban), ban_steps=steps)
            for name, lengths in (("reroll", (C, C)), ("shorter", (C // 2, C // 4))):
                text_, extra, k = row["base"], 0, sub
                for n in lengths:
                    if text_:
                        break
                    k = mx.random.split(k, 3)[2]
                    blk, steps = first_block(plain[n], cache, p, k, n)
                    text_, extra = answer(blk), extra + steps
                row.update({name: text_, f"{name}_extra_steps": extra})
            rows.append(row)
            print(f"[empty] {text!r} s{seed}: base {row['base'][:30]!r} | ban {row['ban'][:30]!r} | "
                  f"reroll {row['reroll'][:30]!r} | shorter {row['shorter'][:30]!r}", file=sys.stderr, flush=True)
    summary = {}
    for name in ("base", "ban", "reroll", "shorter"):
        texts = [r[name] for r in rows]
        known = [word_share(t, words, td) for t in texts]
        first_word_known = [bool(td.WORD.findall(t)) and td.WORD.findall(t)[0].lower() in words for t in texts]
        summary[name] = {"answered": sum(bool(t.strip()) for t in texts), "of": len(texts),
                         "first_word_is_a_corpus_word": sum(first_word_known),
                         "corpus_word_share": sum(k for k, _ in known) / max(1, sum(n for _, n in known)),
                         "mean_words": statistics.mean(n for _, n in known)}
    summary["ban"]["mean_steps"] = statistics.mean(r["ban_steps"] for r in rows)
    summary["base"]["mean_steps"] = statistics.mean(r["base_steps"] for r in rows)
    for name in ("reroll", "shorter"):
        summary[name]["mean_extra_steps"] = statistics.mean(r[f"{name}_extra_steps"] for r in rows)
    return {"machine": machine(), "prompts": TERSE[: args.prompts], "seeds": args.seeds, "summary": summary, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--json")
    m = sub.add_parser("commit")
    m.add_argument("--prompts", type=int, default=12)
    m.add_argument("--seeds", type=int, default=3)
    m.add_argument("--steps", type=int, default=48)
    m.add_argument("--max-tokens", type=int, default=256)
    m.add_argument("--json")
    e = sub.add_parser("empty")
    e.add_argument("--prompts", type=int, default=len(TERSE), help=f"the first N of the {len(TERSE)} terse prompts")
    e.add_argument("--seeds", type=int, default=5)
    e.add_argument("--json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = {"corpus": corpus, "commit": commit, "empty": empty}[args.cmd](args)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    summary = {k: v for k, v in res.items() if k not in ("rows",)}
    if args.cmd == "commit":
        summary = {name: {k: v for k, v in m.items() if k != "blocks"} for name, m in res["models"].items()}
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
