"""``mlx-dgemma``: convert, verify, generate, chat, bench, serve.

One function per subcommand (``_cmd_*``), the flags they share, the parser and ``main``.
Errors a user can act on print as one line and exit with status 2 (``--debug`` shows the
traceback); heavy imports happen inside the subcommands so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import DGemmaError, Terminated, terminate_as_interrupt

# --------------------------------------------------------------------------- convert, verify


def _cmd_convert(args: argparse.Namespace) -> int:
    import math

    from mlx_dgemma.convert.converter import convert

    from .errors import ParameterError
    from .progress import ProgressBar

    if not (math.isfinite(args.max_shard_gb) and 0.001 <= args.max_shard_gb <= 1e6):
        raise ParameterError(f"--max-shard-gb {args.max_shard_gb}: must be a number of GB in [0.001, 1e6]")
    bar = ProgressBar("converting")
    report = convert(args.gguf, args.out_dir, compact=args.compact, force=args.force,
                     max_shard_bytes=int(args.max_shard_gb * 1e9),
                     progress=lambda done, total, i, n, name: bar.update(done, total, f"{i}/{n} {name}"))
    print("\n".join(report.summary_lines()))
    if args.verify:
        return _run_verify(args.out_dir, args.gguf)
    return 0


def _run_verify(out_dir: str, gguf: str) -> int:
    from mlx_dgemma.convert.verify import verify

    from .progress import ProgressBar

    bar = ProgressBar("verifying", unit="tensors", scale=1)
    report = verify(out_dir, gguf, progress=lambda i, n, name: bar.update(i, n, name))
    for line in report.mismatches:
        print(f"MISMATCH {line}")
    if report.compact:  # lossy by design: held to the error bounds its conversion recorded
        verdict = (f"a --compact directory: {report.exact} exact, {len(report.max_abs_error)} within the recorded "
                   "compact error bounds" if report.ok else f"{len(report.mismatches)} tensor(s) outside the "
                   "recorded compact error bounds")
    else:
        verdict = "all exact" if report.ok else f"{len(report.mismatches)} tensor(s) differ"
    print(f"verified {report.checked} tensors of {out_dir} against {gguf}: {verdict}")
    return 0 if report.ok else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    return _run_verify(args.out_dir, args.gguf)


# --------------------------------------------------------------------------- generate, chat, bench, serve

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
    g.add_argument("--accept-probability", type=float, metavar="P",
                   help="confidence-threshold acceptance instead of EntropyBound: reveal a position once its "
                        "top probability reaches P (mlx-vlm's default: 0.9); fewer steps, answers differ")
    g.add_argument("--seed", type=int, help="make the run reproducible")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--dtype``: the runtime precision (see mlx_dgemma.precision)."""
    p.add_argument("--precision", choices=("auto", "exact", "fast"), default="auto",
                   help="runtime precision: exact = float32 and bit-exact weights; fast = bfloat16 on a GPU "
                        "(float32 on the CPU), scales in that dtype, 16-element sub-blocks re-quantized to "
                        "8 bits; auto (default) = fast. Files on disk are exact either way")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype of fast precision (default: bfloat16 on a GPU, float32 on the CPU)")


# generation parameter -> the flag that sets it (errors name what the user typed)
FLAGS = {"max_new_tokens": "--max-tokens", "max_denoising_steps": "--steps", "t_min": "--t-min",
         "t_max": "--t-max", "entropy_bound": "--entropy-bound", "stability_threshold": "--stability-threshold",
         "confidence_threshold": "--confidence-threshold", "sc_top_k": "--sc-top-k", "seed": "--seed",
         "accept_probability": "--accept-probability"}


def sampler_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler flags given, checked one by one (range, finiteness) before any loading."""
    from .sampler import check_field

    out = {k: getattr(args, k) for k in FLAGS if getattr(args, k, None) is not None}
    for k, v in out.items():
        with flag_errors(out):
            check_field(k, v)
    return out


@contextmanager
def flag_errors(overrides: dict[str, Any]) -> Iterator[None]:
    """Restate a ParameterError about a generation parameter set by a flag with the flag's name."""
    from .errors import ParameterError

    try:
        yield
    except ParameterError as e:
        if e.param not in overrides or not e.rule:
            raise
        raise ParameterError(f"{FLAGS[e.param]} {overrides[e.param]!r}: must be {e.rule}",
                             param=e.param, rule=e.rule) from e


def check_sampler_flags(overrides: dict[str, Any], generation_config: dict | None = None) -> None:
    """Validate the sampler flags against the model's defaults; errors name the flag typed."""
    from .errors import ParameterError
    from .sampler import SamplerParams

    try:
        SamplerParams.from_config(generation_config, **overrides)
    except ParameterError as e:
        if e.name not in FLAGS:
            raise
        if e.name == "t_max" and "t_max" not in overrides:  # only --t-min was given: name it
            t_max = SamplerParams.from_config(generation_config).t_max
            raise ParameterError(f"--t-min {overrides['t_min']}: must be below the first-step temperature "
                                 f"({t_max}); lower --t-min or raise --t-max") from None
        t_min = overrides.get("t_min", (generation_config or {}).get("t_min", SamplerParams.t_min))
        rule = {"sc_top_k": "an integer >= 1 (leave --sc-top-k out for exact self-conditioning)",
                "t_max": f"above the final temperature (--t-min, {t_min})"}.get(e.name, e.rule)
        raise ParameterError(f"{FLAGS[e.name]} {overrides.get(e.name)}: must be {rule}") from None


def load_for_cli(model: str | None, demo: bool, dtype: str | None = None, precision: str = "auto"):
    """(model, tokenizer) from --model or --demo (the core's ``open_model``), loading progress on stderr."""
    from .loader import open_model
    from .progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name))


def _cmd_generate(args: argparse.Namespace) -> int:
    from .events import BlockEvent, DoneEvent, PrefillEvent, StepEvent
    from .generation import stream_generate
    from .text import printable
    from .tokenizer import check_text
    from .trace import check_trace_path

    overrides = sampler_overrides(args)
    check_sampler_flags({k: v for k, v in overrides.items() if k not in ("t_min", "t_max")})  # before loading
    check_text(args.prompt, "--prompt")
    if args.trace:
        check_trace_path(args.trace, "--trace")
    model, tokenizer = load_for_cli(args.model, args.demo, args.dtype, args.precision)
    gen_cfg = getattr(model, "generation_config", None)
    check_sampler_flags(overrides, gen_cfg)  # against the model's own defaults
    if getattr(model, "is_demo", False) and not args.json:
        from .demo import DEMO_NOTICES

        print(f"[demo] {DEMO_NOTICES[getattr(model, 'demo_kind', 'trained')]}", file=sys.stderr)
    printed = 0
    done: DoneEvent | None = None
    trace = None
    if args.trace:
        from .trace import Trace

        trace = Trace()
    with flag_errors(overrides):  # the flags against the model's config and vocabulary, before any work
        from .sampler import SamplerParams

        SamplerParams.from_config(gen_cfg, **overrides).check_model(model.args.vocab_size)
    for ev in stream_generate(model, tokenizer, args.prompt, generation_config=gen_cfg,
                              enable_thinking=args.think, chat=not args.raw, **overrides):
        if isinstance(ev, PrefillEvent) and not args.json:
            print(f"[prefill] {ev.tokens} tokens in {ev.seconds:.2f} s", file=sys.stderr)
        if isinstance(ev, StepEvent) and trace is not None:
            trace.add(ev)
        if isinstance(ev, StepEvent) and args.show_drafts and not args.json:
            draft = printable(tokenizer.decode(ev.draft.tolist()).replace("\n", " "))
            print(f"[block {ev.block + 1} step {ev.step:>2}] T={ev.temperature:.3f} "
                  f"accepted {int(ev.accepted.sum()):>3}/{ev.accepted.size} H={ev.mean_entropy:.3f} | {draft[:100]}",
                  file=sys.stderr)
        elif isinstance(ev, BlockEvent) and not args.json:
            # a model can emit any byte: control characters are shown escaped, never sent raw
            sys.stdout.write(printable(ev.text[printed:] if ev.text.startswith(ev.text[:printed])
                                       else "\n" + ev.text))
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
               "peak_memory_gb": round(done.peak_memory_bytes / 1e9, 3), "precision": done.precision}
    if args.json:
        print(json.dumps({"text": done.text, "thinking": done.thinking, "tokens": list(done.tokens), **summary}))
    else:
        print()
        print(f"[done] {done.finish_reason}; {done.steps} steps {list(done.steps_per_block)}, "
              f"{done.seconds_per_step:.3f} s/step, {done.tokens_per_forward:.2f} tokens/forward, "
              f"prefill {done.prefill_tokens_per_second:.1f} tok/s, peak {done.peak_memory_bytes / 1e9:.2f} GB, "
              f"{done.precision}",
              file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from .loader import check_model_choice

    check_model_choice(args.model, args.demo)
    from mlx_dgemma.tui.app import run_app

    from .precision import resolve_precision

    resolve_precision(args.precision, args.dtype)  # a contradiction is an error before the app starts
    return run_app(model=args.model, demo=args.demo, dtype=args.dtype, precision=args.precision)


CHAT_EPILOG = """\
keys:
  Enter            send the message
  Escape           cancel the answer (at the next step)
  Ctrl+B / Ctrl+F  replay: step backward / forward through the denoising steps
  Ctrl+T           export the answer's trace as JSON lines
  Ctrl+O           sampler settings
  Ctrl+N           new chat (drops the cache)
  Ctrl+Q           quit

environment:
  MLX_DGEMMA_MODEL  the model to use when --model is not given (~ is expanded);
                    with neither, the app offers the built-in demo model
"""


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import main as serve_main

    return serve_main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor_main

    return doctor_main(args)


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    """Add the model-running subcommands (generate, chat, bench, serve) to the parser."""
    g = sub.add_parser("generate", help="generate an answer, streamed to stdout",
                       description="Generate an answer, streamed to stdout (progress and timings on stderr). "
                                   "Try it first with: mlx-dgemma generate --demo --prompt 'Hi' --seed 0")
    g.add_argument("--model", help="converted directory or .gguf file")
    g.add_argument("--demo", action="store_true", help=DEMO_HELP)
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--raw", action="store_true", help="no chat template: the prompt is the raw text")
    g.add_argument("--think", action="store_true", help="enable the thought channel")
    g.add_argument("--show-drafts", action="store_true", help="print each step's draft to stderr")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--trace", metavar="FILE", help="write every denoising step as JSON lines to FILE")
    add_precision_args(g)
    add_sampler_args(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="interactive terminal chat that shows the canvas denoising",
                       description="Interactive terminal chat that shows the canvas denoising, step by step.",
                       epilog=CHAT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", help="converted directory or .gguf file (default: $MLX_DGEMMA_MODEL)")
    c.add_argument("--demo", action="store_true", help=DEMO_HELP)
    add_precision_args(c)
    c.set_defaults(func=_cmd_chat)

    b = sub.add_parser("bench", help="per-step speed and memory against mlx-vlm and transformers")
    from .bench import add_args

    add_args(b)
    b.set_defaults(func=_cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, streamed blocks and steps)")
    from .server import add_args as add_serve_args

    add_serve_args(s)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("doctor", help="check this machine: device, memory, and GPU results against MLX's CPU",
                       description="Report the device, MLX version and backend, the memory the GPU may use, "
                                   "and run the model's operations on the default device and on MLX's CPU "
                                   "stream on a fixed input: exit 0 when they agree, 1 when a check fails.")
    from .doctor import add_args as add_doctor_args

    add_doctor_args(d)
    d.set_defaults(func=_cmd_doctor)


# --------------------------------------------------------------------------- the parser, main

DESCRIPTION = "Run DiffusionGemma from its GGUF files with MLX: convert, verify, generate, chat, bench."
EPILOG = """\
first time? the built-in demo (a tiny model trained on the KJV Bible) shows text denoising:
  mlx-dgemma chat --demo
then a real model (README: Using a real model):
  mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf ~/models/dgemma
  mlx-dgemma chat --model ~/models/dgemma

mlx-dgemma COMMAND --help shows each command's options."""
DEBUG_HELP = "show tracebacks on errors"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="mlx-dgemma", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mlx-dgemma {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="repack a DiffusionGemma GGUF into an MLX model directory")
    c.add_argument("gguf", help="the .gguf file")
    c.add_argument("out_dir", help="output directory, created with its parents (must not exist unless --force)")
    c.add_argument("--compact", action="store_true",
                   help="smaller but lossy: float16 scales, 8-bit groups for Q6_K (default: exact)")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--verify", action="store_true", help="verify every tensor after converting")
    c.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GB)")
    c.set_defaults(func=_cmd_convert)

    v = sub.add_parser("verify", help="check a converted directory against its GGUF, bit for bit")
    v.add_argument("out_dir", help="the directory written by mlx-dgemma convert")
    v.add_argument("gguf", help="the .gguf file it was converted from")
    v.set_defaults(func=_cmd_verify)

    add_model_commands(sub)
    for command in sub.choices.values():  # --debug also after the subcommand (SUPPRESS: no clobbering)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP clean up like Ctrl+C
            return int(args.func(args) or 0)
    except DGemmaError as e:
        if args.debug:
            raise
        # one line whatever a file put in the message (names with newlines, control bytes)
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(e))
        print(f"mlx-dgemma {args.command}: error: {text}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(f"mlx-dgemma {args.command}: interrupted; nothing partial was kept", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
