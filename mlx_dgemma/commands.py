"""Subcommands that run the model: generate, chat, bench."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEMO_HELP = ("the built-in demo model: a tiny model trained on the King James Bible "
             "(not DiffusionGemma's weights)")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampler (defaults from the model's generation_config.json)")
    g.add_argument("--max-tokens", type=int, dest="max_new_tokens", help="new tokens (rounded up to whole canvases)")
    g.add_argument("--steps", type=int, dest="max_denoising_steps", help="max denoising steps per block")
    g.add_argument("--t-min", type=float, help="final temperature of the linear schedule")
    g.add_argument("--t-max", type=float, help="first-step temperature")
    g.add_argument("--entropy-bound", type=float, help="EntropyBound acceptance budget")
    g.add_argument("--stability-threshold", type=int, help="identical argmax canvases needed to stop")
    g.add_argument("--confidence-threshold", type=float, help="mean entropy needed to stop")
    g.add_argument("--sc-top-k", type=int, help="approximate self-conditioning with the top K tokens")
    g.add_argument("--seed", type=int, help="make the run reproducible")


def sampler_overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "entropy_bound",
            "stability_threshold", "confidence_threshold", "sc_top_k", "seed")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def load_for_cli(model: str | None, demo: bool, dtype: str = "float32"):
    """(model, tokenizer) from --model or --demo, with loading progress on stderr."""
    import mlx.core as mx

    from .errors import ParameterError
    from .progress import ProgressBar

    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
    if demo:
        from .demo import load_demo

        return load_demo(dtype=dt)
    if not model:
        raise ParameterError("--model: not given; pass a converted directory or a .gguf file "
                             "(or --demo for the built-in demo model)")
    from .api import load

    bar = ProgressBar("loading", unit="tensors", scale=1)
    return load(model, dtype=dt, progress=lambda i, n, name: bar.update(i, n, name))


def _cmd_generate(args: argparse.Namespace) -> int:
    from .generation import BlockEvent, DoneEvent, PrefillEvent, StepEvent, stream_generate

    model, tokenizer = load_for_cli(args.model, args.demo, args.dtype)
    overrides = sampler_overrides(args)
    gen_cfg = getattr(model, "generation_config", None)
    printed = 0
    done: DoneEvent | None = None
    trace = None
    if args.trace:
        from .trace import Trace

        trace = Trace()
    for ev in stream_generate(model, tokenizer, args.prompt, generation_config=gen_cfg,
                              enable_thinking=args.think, chat=not args.raw, **overrides):
        if isinstance(ev, PrefillEvent) and not args.json:
            print(f"[prefill] {ev.tokens} tokens in {ev.seconds:.2f} s", file=sys.stderr)
        if isinstance(ev, StepEvent) and trace is not None:
            trace.add(ev)
        if isinstance(ev, StepEvent) and args.show_drafts and not args.json:
            draft = tokenizer.decode(ev.draft.tolist()).replace("\n", " ")
            print(f"[block {ev.block + 1} step {ev.step:>2}] T={ev.temperature:.3f} "
                  f"accepted {int(ev.accepted.sum()):>3}/{ev.accepted.size} H={ev.mean_entropy:.3f} | {draft[:100]}",
                  file=sys.stderr)
        elif isinstance(ev, BlockEvent) and not args.json:
            sys.stdout.write(ev.text[printed:] if ev.text.startswith(ev.text[:printed]) else "\n" + ev.text)
            sys.stdout.flush()
            printed = len(ev.text)
        elif isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    if trace is not None:
        trace.export_jsonl(args.trace, tokenizer.decode)
    summary = {"finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
               "prefill_tokens_per_second": round(done.prefill_tokens_per_second, 2),
               "steps": done.steps, "steps_per_block": list(done.steps_per_block),
               "seconds_per_step": round(done.seconds_per_step, 4),
               "tokens_per_forward": round(done.tokens_per_forward, 3),
               "peak_memory_gb": round(done.peak_memory_bytes / 1e9, 3)}
    if args.json:
        print(json.dumps({"text": done.text, "thinking": done.thinking, "tokens": list(done.tokens), **summary}))
    else:
        print()
        print(f"[done] {done.finish_reason}; {done.steps} steps {list(done.steps_per_block)}, "
              f"{done.seconds_per_step:.3f} s/step, {done.tokens_per_forward:.2f} tokens/forward, "
              f"prefill {done.prefill_tokens_per_second:.1f} tok/s, peak {done.peak_memory_bytes / 1e9:.2f} GB",
              file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from .tui.app import run_app

    return run_app(model=args.model, demo=args.demo, dtype=args.dtype)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the model-running subcommands to the ``mlx-dgemma`` parser."""
    g = sub.add_parser("generate", help="generate an answer, streamed to stdout")
    g.add_argument("--model", help="converted directory or .gguf file")
    g.add_argument("--demo", action="store_true", help=DEMO_HELP)
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--raw", action="store_true", help="no chat template: the prompt is the raw text")
    g.add_argument("--think", action="store_true", help="enable the thought channel")
    g.add_argument("--show-drafts", action="store_true", help="print each step's draft to stderr")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--trace", metavar="FILE", help="write every denoising step as JSON lines to FILE")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    add_sampler_args(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="interactive terminal chat that shows the canvas denoising")
    c.add_argument("--model", help="converted directory or .gguf file")
    c.add_argument("--demo", action="store_true", help=DEMO_HELP)
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    c.set_defaults(func=_cmd_chat)

    b = sub.add_parser("bench", help="per-step speed and memory against mlx-vlm and transformers")
    from .bench import add_args

    add_args(b)
    b.set_defaults(func=_cmd_bench)
