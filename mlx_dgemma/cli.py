"""``mlx-dgemma``: convert, verify, plan, generate, chat, bench, serve, doctor.

One function per subcommand (``_cmd_*``), the parser and ``main``; the flags several commands share
are :mod:`mlx_dgemma.cli_options`' (importable from here too), ``generate`` is
:mod:`mlx_dgemma.cli_generate`, and bench, serve and doctor bring their own options.
Errors a user can act on print as one line and exit with status 2 (``--debug`` shows the
traceback); heavy imports happen inside the subcommands so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .cli_options import (  # noqa: F401 (re-exported: the shared flags and request helpers, standard library)
    DEMO_HELP, add_precision_args, add_quality_arg, add_sampler_args, load_for_cli, memory_limit, planned_load,
    sampler_overrides)
from .errors import DGemmaError, Terminated, hold_interrupts, terminate_as_interrupt
from .stdio import standard_streams, stdout_closed  # imported here: no import between main() and its handlers

if TYPE_CHECKING:
    from .plan import Plan


# --------------------------------------------------------------------------- convert, verify


def _cmd_convert(args: argparse.Namespace) -> int:
    import math

    from .errors import ParameterError
    from .paths import check_gguf_input

    if not (math.isfinite(args.max_shard_gb) and 0.001 <= args.max_shard_gb <= 1e6):
        raise ParameterError(f"--max-shard-gb {args.max_shard_gb}: must be a number of GB in [0.001, 1e6]")
    if args.machine is not None and args.memory_limit is not None:
        raise ParameterError(f"--machine {args.machine} --memory-limit {args.memory_limit}: give one of them "
                             "(a Mac's budget is its GPU's default working set)")
    from .machines import machine
    from .plan import offline_budget

    # where the output must run (no MLX: the converter never imports it): --machine, --memory-limit,
    # else this machine; told before anything is written when the form will not run there
    budget = offline_budget(memory_limit(args), machine(args.machine) if args.machine else None)
    check_gguf_input(args.gguf)  # a mistyped path fails before the converter's imports
    from mlx_dgemma.convert.converter import REPORT_FILE, convert

    from .errors import OutputError
    from .progress import ProgressBar

    bar = ProgressBar("converting")
    report = convert(args.gguf, args.out_dir, precision=args.precision, force=args.force,
                     max_shard_bytes=int(args.max_shard_gb * 1e9),
                     progress=lambda done, total, i, n, name: bar.update(done, total, f"{i}/{n} {name}"),
                     budget=budget, notice=lambda line: print(line, file=sys.stderr, flush=True))
    try:  # with --verify, its error line (recomputed from the GGUF) is the one printed
        print("\n".join(report.summary_lines(errors=not args.verify)), flush=True)
    except OutputError as e:  # the directory is whole: say so, not just that the summary was lost
        raise OutputError(f"{e} (the conversion itself is complete: {report.output}, its summary in "
                          f"{REPORT_FILE} there)") from None
    if args.verify:
        return _run_verify(args.out_dir, args.gguf)
    return 0


def _run_verify(out_dir: str, gguf: str) -> int:
    with hold_interrupts():  # MLX's, numpy's and gguf's imports (see hold_interrupts)
        from mlx_dgemma.convert.verify import verify

    from .progress import ProgressBar

    bar = ProgressBar("verifying", unit="tensors", scale=1)
    report = verify(out_dir, gguf, progress=lambda i, n, name: bar.update(i, n, name))
    for line in report.mismatches:
        print(f"MISMATCH {line}")
    if report.lossy:  # lossy by design: each tensor held to the bound its precision allows
        if report.max_abs_error:
            print(report.bound_summary())
        verdict = (f"a {report.precision} directory: {report.exact} exact, {len(report.max_abs_error)} within "
                   f"{report.precision}'s error bounds (recomputed from the GGUF)" if report.ok
                   else f"{len(report.mismatches)} tensor(s) outside {report.precision}'s error bounds")
    else:
        verdict = "all exact" if report.ok else f"{len(report.mismatches)} tensor(s) differ"
    print(f"verified {report.checked} tensors of {out_dir} against {gguf}: {verdict}")
    return 0 if report.ok else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    from .paths import check_gguf_input

    from pathlib import Path

    from .errors import ModelFilesError

    gguf, out = Path(args.gguf).expanduser(), Path(args.out_dir).expanduser()
    if gguf.is_dir() and out.is_file() and out.suffix.lower() == ".gguf":  # the usual slip: FILE first
        raise ModelFilesError(f"{args.out_dir} and {args.gguf}: the other way round; the converted directory "
                              f"comes first: mlx-dgemma verify {args.gguf} {args.out_dir}")
    check_gguf_input(args.gguf)  # a mistyped path fails before the verifier's imports
    return _run_verify(args.out_dir, args.gguf)


# --------------------------------------------------------------------------- generate, chat, bench, serve


def _cmd_generate(args: argparse.Namespace) -> int:
    from .cli_generate import main as generate_main

    return generate_main(args)


def _cmd_chat(args: argparse.Namespace) -> int:
    from .launch import need_terminal
    from .paths import resolve_model
    from .tiers import check_precision_dtype  # no MLX

    # --model, else $MLX_DGEMMA_MODEL, checked before Textual and MLX load; neither: the app offers the demo
    model = resolve_model(args.model, args.demo, required=False)
    check_precision_dtype(args.precision, args.dtype)  # a contradiction is an error before the app starts
    need_terminal("chat")  # no terminal (a script, `< /dev/null`): refused before Textual's and MLX's imports
    with hold_interrupts():
        from mlx_dgemma.tui.app import run_app

    if args.system is not None:
        from .tokenizer import check_text

        check_text(args.system, "--system")
    args.model = model
    from .errors import MemoryBudgetError

    from .launch import launched, launched_rank, rank_terminal

    ranks = launched()
    if ranks and not (model or args.demo):  # the other ranks must load what rank 0 loads
        from .errors import ParameterError

        raise ParameterError("chat under mlx.launch needs --model PATH or --demo (or MLX_DGEMMA_MODEL)")
    plan = None
    try:
        plan = planned_load(args)  # a model that does not fit is refused before the app starts
    except MemoryBudgetError:
        raise
    except DGemmaError:  # a file that cannot be read: the app says why and offers the demo
        if ranks:
            raise
    # the app's load reads the model this plan opened, in the precision it chose
    precision = plan.chosen if plan is not None else args.precision
    if ranks and launched_rank() > 0:  # rank 0 owns the app; this rank runs its model calls
        return _follow_chat(args, precision, plan)
    if ranks:
        with rank_terminal("chat"):
            return run_app(model=model, demo=args.demo, dtype=args.dtype, precision=precision,
                           think=args.think, system=args.system, memory_limit=memory_limit(args),
                           quality=args.quality, plan=plan)
    return run_app(model=model, demo=args.demo, dtype=args.dtype, precision=precision,
                   think=args.think, system=args.system, memory_limit=memory_limit(args), quality=args.quality,
                   plan=plan)


def _follow_chat(args: argparse.Namespace, precision: str, plan: Plan | None = None) -> int:
    """A rank > 0 of ``chat`` under ``mlx.launch``: load this rank's slices and run every model
    call rank 0's app makes (``ModelRuntime.follow``) until it quits (Ctrl+Q there).

    The launcher copies its terminal's input to every rank: this rank's stdin is closed (the
    launcher then stops writing to it) and Ctrl+C is ignored (rank 0 decides when to stop;
    if it dies, the ring breaks and this rank says so in one line)."""
    import os
    import signal

    from .lockstep import run_follower

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    run_follower(load_for_cli(args.model, args.demo, args.dtype, precision, memory_limit(args), plan), "chat")


CHAT_EPILOG = """\
keys:
  Enter            send the message
  Escape           cancel the answer (at the next step)
  Ctrl+B / Ctrl+F  replay: step backward / forward through the denoising steps
  Ctrl+T           export the answer's trace as JSON lines (a header, then the steps)
  Ctrl+O           settings: sampler, thought channel, system prompt
  Ctrl+N           new chat (drops the cache)
  Ctrl+Q           quit (an answer in progress stops at the next step first)

environment:
  MLX_DGEMMA_MODEL  the model to use when --model is not given (~ is expanded);
                    with neither, the app offers the built-in demo model
"""


GENERATE_EPILOG = """\
environment: MLX_DGEMMA_MODEL is the model when neither --model nor --demo is given (~ is expanded)"""

SERVE_EPILOG = """\
environment:
  MLX_DGEMMA_MODEL  the model to serve when neither --model nor --demo is given (~ is expanded)"""


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .paths import resolve_model

    # --model, else $MLX_DGEMMA_MODEL (checked here: a mistyped path fails before the server's imports)
    args.model = resolve_model(args.model, args.demo)
    from .tiers import check_precision_dtype  # no MLX

    check_precision_dtype(args.precision, args.dtype)
    with hold_interrupts():
        from .demo import DEMO_NOTICES
        from .server import check_args, main as serve_main
    check_args(args)  # a bad flag is the one line printed, before the notice and the memory plan
    # refused before the server starts if it does not fit; the server's load reads what it opened
    args.plan = planned_load(args)
    args.precision = args.plan.chosen
    if args.demo:
        print(f"[demo] {DEMO_NOTICES['trained']}", file=sys.stderr, flush=True)
    return serve_main(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    if args.context is not None and not (isinstance(args.context, int) and 1 <= args.context <= 1 << 22):
        from .errors import ParameterError

        raise ParameterError(f"--context {args.context}: must be a number of tokens in [1, 4194304]")
    from .demo import demo_file
    from .paths import resolve_model

    # MODEL, else $MLX_DGEMMA_MODEL, checked; --demo: the demo's file, planned like any other
    args.model = resolve_model(args.model, args.demo, flag="MODEL") or str(demo_file("trained"))

    with hold_interrupts():  # MLX: a native init that loses or aborts on Ctrl+C
        from .loader import plan_model

    limit = memory_limit(args)
    if args.machine is not None:
        from .errors import ParameterError
        from .machines import machine

        if limit is not None:
            raise ParameterError(f"--machine {args.machine} --memory-limit {args.memory_limit}: give one of them "
                                 "(a Mac's budget is its GPU's default working set)")
        if args.machine != "all":
            machine(args.machine)  # a misspelt name fails before the model is read
    if args.machine == "all":  # every preset: "which Mac, which form, which command"
        from .loader import model_inventory
        from .plan import machine_table, markdown_table

        margs, inventory, stored = model_inventory(args.model)
        rows = machine_table(args.model, margs, inventory, stored, args.context)
        print(json.dumps(rows, indent=2) if args.json else "\n".join(markdown_table(rows)))
        return 0 if any(r["auto"] for r in rows) else 1
    if args.ranks is None:  # this process's share under mlx.launch, else the whole model
        plan = plan_model(args.model, limit, args.context, machine=args.machine)
    else:
        if not 1 <= args.ranks <= 64:
            from .errors import ParameterError

            raise ParameterError(f"--ranks {args.ranks}: must be a number of Macs (processes) in [1, 64]")
        from .loader import ModelSource

        # the ranks' shares differ by a vocabulary row at most: show the largest (the model opened once)
        with ModelSource.open(args.model) as source:
            plan = max((plan_model(source, limit, args.context, ranks=args.ranks, rank=r, machine=args.machine)
                        for r in range(args.ranks)), key=lambda p: p.row("exact").needed_bytes)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else "\n".join(plan.table()))
    return 0 if plan.best_fit(plan.auto_candidates) else 1  # a script can ask "does it fit?" (1: nothing does)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor_main

    return doctor_main(args)


def add_model_commands(sub: argparse._SubParsersAction, command: str | None = None) -> None:
    """Add the model-running subcommands (generate, chat, bench, serve, doctor) to the parser.
    The options of ``bench``, ``serve`` and ``doctor`` come from their modules, which import
    numpy, MLX or pydantic: with ``command`` (the subcommand being run) only that one's are
    added, so ``--help``, ``--version`` and the other commands start without those imports."""
    g = sub.add_parser("generate", help="generate an answer, streamed to stdout",
                       description="Generate an answer, streamed to stdout (progress and timings on stderr). "
                                   "Try it first with: mlx-dgemma generate --demo --prompt 'Hi' --seed 0")
    g.add_argument("--model", metavar="PATH", help="converted directory or .gguf file (default: $MLX_DGEMMA_MODEL)")
    g.add_argument("--demo", action="store_true", help=DEMO_HELP)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the user message ('-': read it from standard input)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the user message from a UTF-8 file ('-': stdin)")
    g.add_argument("--raw", action="store_true", help="no chat template: the prompt is the raw text")
    g.add_argument("--think", action="store_true", help="enable the thought channel")
    g.add_argument("--show-drafts", action="store_true", help="print each step's draft to stderr")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--trace", metavar="FILE", help="write every denoising step as JSON lines to FILE")
    g.add_argument("--canvas-template", metavar="TEXT",
                   help="fix the answer's first positions to TEXT's tokens, held by the denoiser; {{N}} in TEXT "
                        "leaves N positions for the model (e.g. 'Name: {{4}}. Age: {{2}}.'), and so does "
                        "everything after TEXT")
    add_precision_args(g)
    add_sampler_args(g)
    g.epilog = GENERATE_EPILOG
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="interactive terminal chat that shows the canvas denoising",
                       description="Interactive terminal chat that shows the canvas denoising, step by step.",
                       epilog=CHAT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", metavar="PATH", help="converted directory or .gguf file (default: $MLX_DGEMMA_MODEL)")
    c.add_argument("--demo", action="store_true", help=DEMO_HELP)
    c.add_argument("--think", action="store_true", help="enable the thought channel (shown collapsed; Ctrl+O changes it)")
    c.add_argument("--system", metavar="TEXT", help="system prompt of the conversation (Ctrl+O changes it)")
    add_quality_arg(c)
    add_precision_args(c)
    c.set_defaults(func=_cmd_chat)

    b = sub.add_parser("bench", help="per-step speed and memory against mlx-vlm and transformers",
                       description="Benchmark on random weights: seconds per denoising step, prefill tokens/s "
                                   "and peak memory for the chosen configs, against mlx-vlm's DiffusionGemma and "
                                   "the transformers reference on the same weights in the same run. Prints a "
                                   "table and JSON.",
                       )
    if command in (None, "bench"):
        from .bench import DefaultsHelpFormatter, add_args

        b.formatter_class = DefaultsHelpFormatter
        add_args(b)
    b.set_defaults(func=_cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, streamed blocks and steps)",
                       description="Serve a model over the OpenAI API until Ctrl+C: GET /v1/models, POST\n"
                                   "/v1/chat/completions and /v1/completions (streamed or not), GET /health.\n"
                                   "Try it with: mlx-dgemma serve --demo", epilog=SERVE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", metavar="PATH", help="converted directory or .gguf file (default: $MLX_DGEMMA_MODEL)")
    s.add_argument("--demo", action="store_true", help=DEMO_HELP)
    add_precision_args(s)
    if command in (None, "serve"):
        from .server import add_args as add_serve_args

        add_serve_args(s)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("doctor", help="check this machine: device, memory, and GPU results against MLX's CPU",
                       description="Report the device, MLX version and backend, the memory the GPU may use, "
                                   "and run the model's operations on the default device and on MLX's CPU "
                                   "stream on a fixed input: exit 0 when they agree, 1 when a check fails.")
    if command in (None, "doctor"):
        from .doctor import add_args as add_doctor_args

        add_doctor_args(d)
    d.set_defaults(func=_cmd_doctor)


# --------------------------------------------------------------------------- the parser, main

DESCRIPTION = """\
Run DiffusionGemma from its GGUF files with MLX: convert, verify, plan (which precision
fits), generate, chat, serve (an OpenAI-compatible server), doctor (does this machine compute
it right?), bench."""
EPILOG = """\
first time? the built-in demo (a tiny model trained on the KJV Bible) shows text denoising:
  mlx-dgemma chat --demo
then a real model (README: Using a real model; hf comes with pip install -U "huggingface_hub[cli]"):
  hf download unsloth/diffusiongemma-26B-A4B-it-GGUF \\
      diffusiongemma-26B-A4B-it-Q4_K_M.gguf --local-dir .
  mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf ~/models/dgemma
  mlx-dgemma chat --model ~/models/dgemma

mlx-dgemma COMMAND --help shows each command's options."""
DEBUG_HELP = "show tracebacks on errors"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line ``argv``, only the options of the command it
    runs are imported (see :func:`add_model_commands`)."""
    from . import __version__

    p = argparse.ArgumentParser(prog="mlx-dgemma", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mlx-dgemma {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="repack a DiffusionGemma GGUF into an MLX model directory")
    c.add_argument("gguf", help="the .gguf file")
    c.add_argument("out_dir", help="output directory, created with its parents (must not exist, or be empty, "
                                   "unless --force)")
    from .tiers import TIER_ROWS, TIERS

    form = c.add_mutually_exclusive_group()
    form.add_argument("--precision", choices=(*TIERS, "auto"), default="exact",
                      help="the weights' form on disk (default exact, bit for bit); a lossy one is smaller and is "
                           "what a small Mac loads without ever holding the exact form: "
                           + "; ".join(f"{t.name} = {t.help}" for t in TIER_ROWS if not t.lossless)
                           + "; auto = the most exact form that runs on this machine (or --machine, --memory-limit)")
    form.add_argument("--compact", action="store_const", dest="precision", const="fast",
                      help="the same as --precision fast (its older name)")
    c.add_argument("--machine", metavar="NAME",
                   help="the Mac the output is for (mac-24gb, ...; mlx-dgemma plan --help): said before writing "
                        "when the form will not run there; --precision auto writes the most exact that does "
                        "(default: this machine)")
    c.add_argument("--memory-limit", metavar="SIZE", help="as --machine, for a memory budget (e.g. 17GB)")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--verify", action="store_true", help="verify every tensor after converting")
    c.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GB)")
    c.set_defaults(func=_cmd_convert)

    v = sub.add_parser("verify", help="check a converted directory against its GGUF, bit for bit")
    v.add_argument("out_dir", help="the directory written by mlx-dgemma convert")
    v.add_argument("gguf", help="the .gguf file it was converted from")
    v.set_defaults(func=_cmd_verify)

    pl = sub.add_parser("plan", help="memory each precision needs for a model, and whether it fits",
                        description="For every precision: the bytes the weights, the KV cache and a step's working "
                                    "memory need, and whether that fits this machine (or --memory-limit). "
                                    "Reads no weights. Exit status 0 when a precision fits, 1 when none does.")
    pl.add_argument("model", nargs="?", help="converted directory or .gguf file (default: $MLX_DGEMMA_MODEL)")
    pl.add_argument("--demo", action="store_true", help="plan the built-in demo model")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("--memory-limit", metavar="SIZE", help="compare with SIZE (e.g. 14GB) instead of this machine")
    pl.add_argument("--machine", metavar="NAME",
                    help="plan for a Mac instead of this machine: its GPU's default working set (mac-8gb ... "
                         "mac-192gb, M5 variants mac-16gb-m5 ...; see mlx_dgemma/machines.py); all: the table "
                         "of every preset (which Mac, which form, which command)")
    pl.add_argument("--context", type=int, default=None, help="tokens to reserve KV cache for (default 4096)")
    pl.add_argument("--ranks", type=int, default=None, metavar="N",
                    help="price one rank's share of the model split over N Macs (mlx.launch), before launching "
                         "(default: the launched ranks, else 1)")
    pl.set_defaults(func=_cmd_plan)

    # the top-level options take no values: the first other word is the command
    command = next((a for a in argv if not a.startswith("-")), "") if argv is not None else None
    add_model_commands(sub, command)
    for command in sub.choices.values():  # --debug also after the subcommand (SUPPRESS: no clobbering)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        # no abbreviations: `--max-token 5` ran as --max-tokens, and a later flag with the same start
        # would silently change what an old command line means
        command.allow_abbrev = False
    p.allow_abbrev = False
    return p


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option is refused with the usage of the
    command it was given to (argparse's top level said `usage: mlx-dgemma [-h] ... COMMAND`,
    which lists none of that command's options)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        target = subparsers.choices.get(command, parser) if command else parser
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _negative_number(word: str) -> bool:
    """``word`` reads as a negative number (``-1``, ``-1e-300``, ``-inf``, ``-nan``)."""
    if not word.startswith("-") or len(word) < 2:
        return False
    try:
        float(word)
    except ValueError:
        return False
    return True


def joined_negative_values(argv: list[str]) -> list[str]:
    """``argv`` with each negative number that follows an option joined to it (``--flag=-inf``).

    argparse reads a word that starts with '-' as an option unless it is a plain decimal:
    ``--accept-probability -inf`` or ``-1e-300`` got "expected one argument" instead of the
    option's own range check. Joined, the word is the option's value whatever it looks like
    (an option that takes none then says so). Nothing after ``--`` changes."""
    out: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return out + argv[i:]
        if out and _negative_number(word) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Its standard streams are checked and guarded first
    (:mod:`mlx_dgemma.stdio`): a closed standard output is refused, a full one is a one-line
    error, and a failing standard error never costs what goes to standard output."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        with standard_streams():
            if stdout_closed():
                command = next((a for a in argv if not a.startswith("-")), "")
                print(f"mlx-dgemma{' ' + command if command else ''}: error: standard output is closed (>&-); what "
                      "the command prints would be lost, or land in a file it opens: send it somewhere, e.g. "
                      ">/dev/null", file=sys.stderr, flush=True)
                return 2
            return _run(argv)
    except KeyboardInterrupt as e:  # in the instant before _run's own handler (it takes every later one)
        if "--debug" in argv:
            raise
        print("mlx-dgemma: interrupted; nothing partial was kept", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130


def _run(argv: list[str]) -> int:
    """Run one command; its exit status. Errors a user can act on, and Ctrl+C at any moment
    (while the parser is built too), end in one line on stderr unless ``--debug``."""
    args: argparse.Namespace | None = None
    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP clean up like Ctrl+C (from the first moment)
            with hold_interrupts():  # building the parser imports the options of bench or serve
                parser = build_parser(argv)
            if not [a for a in argv if a != "--debug"]:  # bare `mlx-dgemma`: the help, "first time?" included
                parser.print_help(sys.stderr)
                return 2  # a usage error, as any missing argument is
            args = parse_command_line(parser, joined_negative_values(argv))
            check_platform(args.command)
            from .launch import quiet_other_ranks

            quiet_other_ranks()  # under mlx.launch rank 0 alone prints
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at the interpreter's exit
        return code
    except DGemmaError as e:
        from .launch import launched

        if launched():  # a rank that fails before the model is loaded everywhere tells the others
            from .distributed import tell_startup_failure

            tell_startup_failure(e)
        if _debug(args, argv):
            raise
        # one line whatever a file put in the message (names with newlines, control bytes)
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(e))
        print(f"{_who(args)}: error: {text}", file=sys.stderr, flush=True)
        if launched():
            from .distributed import startup_failed, wait_for_rank_0

            if startup_failed():
                wait_for_rank_0()  # rank 0 prints the reason before mlx.launch stops the ranks
        return e.exit_code
    except KeyboardInterrupt as e:
        if _debug(args, argv):
            raise
        print(f"{_who(args)}: interrupted; nothing partial was kept", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130
    except BrokenPipeError:
        # the reader went away (`mlx-dgemma plan M | head -1`): stop quietly, as cat and grep do;
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


# the commands that run a model on MLX's default device (a Mac's GPU)
GPU_COMMANDS = ("generate", "chat", "serve", "bench")


def check_platform(command: str) -> None:
    """Refuse, in one line, a Python that cannot run MLX on this Mac (x86-64: Rosetta or an
    Intel Mac; macOS before 14) and, for the commands that run a model, an MLX without Metal."""
    from .errors import PlatformError
    from .machines import metal_problem, platform_problem

    problem = platform_problem()
    if problem is None and command in GPU_COMMANDS and sys.platform == "darwin":
        with hold_interrupts():  # mlx.core's native init (see hold_interrupts)
            problem = metal_problem()
    if problem is not None:
        raise PlatformError(problem)


def _who(args: argparse.Namespace | None) -> str:
    command = getattr(args, "command", None)
    return f"mlx-dgemma {command}" if command else "mlx-dgemma"


def _debug(args: argparse.Namespace | None, argv: list[str]) -> bool:
    return bool(getattr(args, "debug", False)) if args is not None else "--debug" in argv


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
