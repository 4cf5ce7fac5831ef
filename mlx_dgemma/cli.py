"""``mlx-dgemma``: convert, verify, generate, chat, bench, serve.

One function per subcommand (``_cmd_*``), the flags they share, the parser and ``main``.
Errors a user can act on print as one line and exit with status 2 (``--debug`` shows the
traceback); heavy imports happen inside the subcommands so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from .errors import DGemmaError, Terminated, hold_interrupts, terminate_as_interrupt
from .params import flags  # generation parameter -> its flag (standard library only)
from .stdio import standard_streams, stdout_closed  # imported here: no import between main() and its handlers

if TYPE_CHECKING:
    from .events import StepEvent
    from .request import GenerationRequest


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

    check_gguf_input(args.gguf)  # a mistyped path fails before the verifier's imports
    return _run_verify(args.out_dir, args.gguf)


# --------------------------------------------------------------------------- generate, chat, bench, serve

DEMO_HELP = ("the built-in demo model: a tiny model trained on the King James Bible "
             "(not DiffusionGemma's weights)")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """One flag per generation parameter of the registry (``mlx_dgemma.params``, standard library)."""
    from .params import PARAMS

    g = p.add_argument_group("sampler (defaults from the model's generation_config.json)")
    add_quality_arg(g)
    for param in PARAMS:
        g.add_argument(param.flag, type=param.kind, dest=param.name, metavar=param.metavar, help=param.help)


def add_quality_arg(p: Any) -> None:
    """``--quality``: the speed/quality dial's settings (``mlx_dgemma.params.QUALITIES``)."""
    from .params import QUALITIES

    p.add_argument("--quality", choices=[q.name for q in QUALITIES], default=None,
                   help="speed/quality dial: " + "; ".join(f"{q.name} = {q.help}" for q in QUALITIES)
                        + " (default: max; a sampler flag given besides it wins)")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--dtype``: the runtime precision (see mlx_dgemma.precision)."""
    from .tiers import PRECISIONS, TIER_HELP

    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="runtime precision: " + "; ".join(f"{k} = {v}" for k, v in TIER_HELP.items())
                        + "; auto (default) = fast, or the most exact tier that fits memory "
                        "(mlx-dgemma plan MODEL lists them)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype of the lossy precisions (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--memory-limit", metavar="SIZE", default=None,
                   help="memory the model may use, e.g. 14GB (default: what the device offers: Metal's recommended "
                        "working set, or available RAM); a precision that does not fit is refused before loading")


def planned_precision(args: argparse.Namespace) -> str:
    """--precision after the memory plan (auto -> the most exact form that fits --memory-limit or
    the device); refuses, in one line, a model that does not fit. Nothing is loaded."""
    if not getattr(args, "demo", False) and not getattr(args, "model", None):
        if getattr(args, "memory_limit", None) is not None:
            with hold_interrupts():  # the plan's module imports MLX
                memory_limit(args)  # a bad size is refused even with no model to plan yet
        return args.precision
    # the plan imports MLX (the device's memory): Ctrl+C inside mlx.core's import was swallowed
    # (the server then started anyway) or aborted the process; reading a header takes a moment
    with hold_interrupts():
        from .loader import plan_model
        from .plan import choose_across_ranks

        limit = memory_limit(args)
        if getattr(args, "demo", False):  # the demo is a model file like any other: planned the same
            from .demo import demo_file

            model = demo_file("trained")
        else:
            model = args.model
        # under mlx.launch: this rank's share, and the same precision on every rank
        return choose_across_ranks(plan_model(model, limit), args.precision)


def memory_limit(args: argparse.Namespace) -> int | None:
    """``--memory-limit`` in bytes; None where the command has none or it was not given (given
    empty, it is refused like any other bad size, not taken as absent)."""
    value = getattr(args, "memory_limit", None)
    if value is None:
        return None
    from .plan import parse_size

    return parse_size(value)


def sampler_overrides(args: argparse.Namespace) -> GenerationRequest:
    """The sampler flags given, as the core's request: each checked (range, finiteness) before
    any loading (and before MLX is imported: the rules live in ``params``, standard library
    only); an error names the flag typed."""
    from .request import GenerationRequest

    given = {k: getattr(args, k) for k in flags() if getattr(args, k, None) is not None}
    with flag_errors(given):
        return GenerationRequest.of(given, quality=getattr(args, "quality", None))


@contextmanager
def flag_errors(overrides: Mapping[str, Any]) -> Iterator[None]:
    """Restate a ParameterError about a generation parameter set by a flag in the flag's
    words: ``--steps 0: must be ...`` (the registry's rule, as every front end says it); one
    that names a parameter in a sentence, whoever set it, names its flag."""
    from .errors import ParameterError

    try:
        yield
    except ParameterError as e:
        if e.param in flags() and not e.rule and e.param in str(e):  # named in a sentence: the flag instead
            raise ParameterError(str(e).replace(e.param, flags()[e.param]), param=e.param) from e
        if e.param not in overrides or not e.rule:
            raise
        from .params import PARAMS

        rule = e.rule
        for p in PARAMS:  # a rule between fields names the other by its label: here, by its flag
            if p.label and p.name in flags() and f"the {p.label} (" in rule:
                rule = rule.replace(f"the {p.label} (", f"{flags()[p.name]} (")
        said = ParameterError(str(e), param=e.param, rule=rule, note=e.note)
        raise ParameterError(said.restated(f"{flags()[e.param]} {overrides[e.param]!r}"), param=e.param, rule=rule,
                             note=e.note) from None


def flagged(events: Iterator[Any], overrides: Mapping[str, Any]) -> Iterator[Any]:
    """``events`` with the core's errors (a prompt and answer beyond the context) naming flags."""
    with flag_errors(overrides):
        yield from events


def load_for_cli(model: str | None, demo: bool, dtype: str | None = None, precision: str = "auto",
                 memory_limit: int | None = None):
    """The :class:`~mlx_dgemma.runtime.Runtime` of --model or --demo (the core's ``open_model``), loading
    progress on stderr."""
    from .loader import open_model
    from .progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    limit = {"memory_limit": memory_limit} if memory_limit is not None else {}
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name), **limit)


PROMPT_LIMIT = 64 << 20  # bytes read from --prompt-file or stdin: far beyond any model's context


def read_prompt(args: argparse.Namespace) -> tuple[str, str]:
    """(the prompt text, the flag it came from): ``--prompt TEXT``, ``--prompt -`` (stdin) or
    ``--prompt-file PATH`` (``-``: stdin), read as UTF-8."""
    from .errors import ParameterError
    from .paths import EMPTY, empty_path, input_problem, user_path

    flag = "--prompt" if args.prompt is not None else "--prompt-file"
    source = args.prompt if args.prompt is not None else args.prompt_file
    if args.prompt is not None and args.prompt != "-":
        return args.prompt, flag
    if source == "-":
        if sys.stdin is None:
            raise ParameterError(f"{flag} -: no standard input to read; pipe the prompt in or give it as text")
        if sys.stdin.isatty():
            print("reading the prompt from standard input (end it with Ctrl+D)", file=sys.stderr)
        raw = sys.stdin.buffer.read(PROMPT_LIMIT + 1)
        where = "standard input"
    else:
        path = user_path(source)
        empty = empty_path(source)  # Path("") is ".": "is a directory" would mislead
        problem = EMPTY if empty else input_problem(path, want_dir=False)
        if problem is not None:
            raise ParameterError(f"{flag} {repr(source) if empty else source}: {problem}; give a text file with "
                                 "the prompt ('-': read it from standard input)")
        try:
            with open(path, "rb") as f:
                raw = f.read(PROMPT_LIMIT + 1)
        except OSError as e:
            raise ParameterError(f"{flag} {source}: cannot read it ({e.strerror or e})") from None
        where = str(path)
    if len(raw) > PROMPT_LIMIT:
        raise ParameterError(f"{flag} {source}: {where} holds more than {PROMPT_LIMIT >> 20} MB; give a shorter prompt")
    try:
        return raw.decode("utf-8"), flag
    except UnicodeDecodeError as e:
        raise ParameterError(f"{flag} {source}: {where} is not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at "
                             f"offset {e.start}); give the text in UTF-8") from None


def answer_tokens(tokens: tuple[int, ...], eos_ids: tuple[int, ...]) -> list[int]:
    """The answer's token ids: everything generated before the end-of-turn marker (the first
    EOS id); the marker and the pad ids after it are left out."""
    out: list[int] = []
    for t in tokens:
        if t in eos_ids:
            break
        out.append(t)
    return out


class StepLine:
    """One progress line on a terminal's stderr, redrawn in place at each denoising step
    (block i/n, step k/N, accepted, entropy) and erased before answer text is written."""

    def __init__(self, blocks: int, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.blocks, self.shown = blocks, False

    def show(self, ev: StepEvent) -> None:
        self.stream.write(f"\r\x1b[2K[block {ev.block} (max {self.blocks}) step {ev.step}/{ev.max_steps}] "
                          f"accepted {int(ev.accepted.sum())}/{ev.accepted.size}, H={ev.mean_entropy:.3f}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.shown = False


def _cmd_generate(args: argparse.Namespace) -> int:
    from .paths import check_output_file, resolve_model

    with hold_interrupts():  # the tokenizers package: a Rust (pyo3) init, as pydantic-core's
        from .tokenizer import check_text

    # every argument first, with the standard library only: a mistake answers at once
    request = sampler_overrides(args)
    from .tiers import check_precision_dtype  # no MLX

    check_precision_dtype(args.precision, args.dtype)
    prompt, prompt_flag = read_prompt(args)
    check_text(prompt, prompt_flag)
    if not prompt.strip():  # stream_generate refuses it too, but only after the model has loaded
        from .errors import ParameterError

        raise ParameterError(f"{prompt_flag}: the prompt is empty; give some text")
    model_path = resolve_model(args.model, args.demo)  # --model, else $MLX_DGEMMA_MODEL; checked
    trace_out = None
    if args.trace is not None:  # never over an input of this run: the model, the prompt file
        from .demo import trained_demo_path

        inputs = [model_path or trained_demo_path(), args.prompt_file if args.prompt_file != "-" else None]
        trace_out = check_output_file(args.trace, "--trace", inputs, example="trace.jsonl")
    with hold_interrupts():
        from .events import BlockEvent, DoneEvent, PrefillEvent, StepEvent
        from .generation import stream_generate
        from .text import printable
    limit = memory_limit(args)
    runtime = load_for_cli(model_path, args.demo, args.dtype, args.precision, limit)
    model, tokenizer, gen_cfg = runtime.model, runtime.tokenizer, runtime.generation_config
    with flag_errors(request.params):  # the flags against the model's config and vocabulary, before any work
        params = request.resolve(gen_cfg)
        params.check_model(model.args.vocab_size)
    if runtime.demo_kind is not None and not args.json:
        from .demo import DEMO_NOTICES

        print(f"[demo] {DEMO_NOTICES[runtime.demo_kind]}", file=sys.stderr)
    printed = 0
    done: DoneEvent | None = None
    trace = None
    if trace_out is not None:
        from .trace import Trace, settings_in_effect, trace_header

        settings = settings_in_effect(params, runtime.sc_top_k(params))
        trace = Trace(header=trace_header(prompt, settings, "demo model" if args.demo else str(model_path),
                                          runtime.precision.label, seed=settings.pop("seed"),
                                          thinking=args.think, raw=args.raw))
    if args.canvas_template is not None:
        from .canvas import CanvasTemplate

        template = CanvasTemplate.parse(args.canvas_template, tokenizer)
        C = model.args.canvas_length
        template.check(model.args.vocab_size, -(-params.max_new_tokens // C) * C, name="--canvas-template")
        request = request.with_options(template=template)
    # a step line on a terminal only, and never in the way of the answer: where the answer
    # goes to the same terminal, only until its first words are written
    progress = None
    if not args.json and not args.show_drafts and sys.stderr.isatty():
        import math

        progress = StepLine(math.ceil(params.max_new_tokens / model.args.canvas_length))
    shared_tty = sys.stdout.isatty()
    # the core generates whole blocks (as the reference does); --max-tokens counts tokens, as the
    # server's max_tokens does: the answer shown is its first --max-tokens tokens
    from dataclasses import replace

    from .chat_template import parse_answer
    from .sampler import max_tokens_cut

    def within_max_tokens(tokens: tuple[int, ...], text: str, thinking: str) -> tuple[tuple[int, ...], str, str, bool]:
        at = max_tokens_cut(tokens, params.max_new_tokens, params.pad_token_id)
        if at == len(tokens):
            return tokens, text, thinking, False
        parsed = parse_answer(tokenizer.decode(list(tokens[:at])), strip=not args.raw)
        return tokens[:at], parsed.answer, parsed.thinking, True

    so_far: tuple[int, ...] = ()
    try:  # the step line is erased however the loop ends (Ctrl+C, an error): not left on the terminal
        for ev in flagged(stream_generate(runtime, prompt, request=request, generation_config=gen_cfg,
                                          enable_thinking=args.think, chat=not args.raw), request.params):
            if isinstance(ev, PrefillEvent) and not args.json:
                print(f"[prefill] {ev.tokens} tokens in {ev.seconds:.2f} s", file=sys.stderr)
            if isinstance(ev, StepEvent) and trace is not None:
                trace.add(ev)
            if isinstance(ev, StepEvent) and progress is not None and not (shared_tty and printed):
                progress.show(ev)
            if isinstance(ev, StepEvent) and args.show_drafts and not args.json and ev.attempt > 1 and ev.step == 1:
                # a guard threw the block's drafts so far away (mlx_dgemma.guards): said, not silent
                print(f"[block {ev.block}] re-rolled with a new key (attempt {ev.attempt}): the last attempt did "
                      "not converge (--commit-entropy) or ended the turn before any text (--empty-rerolls)",
                      file=sys.stderr)
            if isinstance(ev, StepEvent) and args.show_drafts and not args.json:
                draft = printable(tokenizer.decode(ev.draft.tolist()).replace("\n", " "))
                print(f"[block {ev.block} step {ev.step:>2}] T={ev.temperature:.3f} "
                      f"accepted {int(ev.accepted.sum()):>3}/{ev.accepted.size} H={ev.mean_entropy:.3f} | {draft[:100]}",
                      file=sys.stderr)
            elif isinstance(ev, BlockEvent) and not args.json:
                if progress is not None:
                    progress.clear()
                so_far += ev.tokens
                text = within_max_tokens(so_far, ev.text, ev.thinking)[1]
                # a model can emit any byte: control characters are shown escaped, never sent raw
                sys.stdout.write(printable(text[printed:] if text.startswith(text[:printed]) else "\n" + text))
                sys.stdout.flush()
                printed = len(text)
            elif isinstance(ev, DoneEvent):
                tokens, text, thinking, cut = within_max_tokens(ev.tokens, ev.text, ev.thinking)
                done = replace(ev, tokens=tokens, text=text, thinking=thinking, finish_reason="length") if cut else ev
    finally:
        if progress is not None:
            progress.clear()
    assert done is not None
    if trace is not None:
        trace.export_jsonl(trace_out, tokenizer.decode)
    summary = {"finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
               "prefill_tokens_per_second": round(done.prefill_tokens_per_second, 2),
               "steps": done.steps, "steps_per_block": list(done.steps_per_block),
               "seconds_per_step": round(done.seconds_per_step, 4),
               "tokens_per_forward": round(done.tokens_per_forward, 3),
               "peak_memory_gb": round(done.peak_memory_bytes / 1e9, 3), "precision": done.precision,
               "ranks": model.ranks}
    if args.json:
        tokens = answer_tokens(done.tokens, params.eos_token_id)
        import json

        print(json.dumps({"text": done.text, "thinking": done.thinking, "tokens": tokens, **summary}))
    else:
        print()
        from .guards import ENDINGS, GUARD_PARAMS

        if done.finish_reason in ENDINGS:  # a guard ended the answer: say which, and how to turn it off
            print(f"[{done.finish_reason}] {ENDINGS[done.finish_reason]}: the answer ends there "
                  f"({flags()[GUARD_PARAMS[done.finish_reason]]} 0 turns this off)", file=sys.stderr)
        print(f"[done] {done.finish_reason}; {done.steps} steps {list(done.steps_per_block)}, "
              f"{done.seconds_per_step:.3f} s/step, {done.tokens_per_forward:.2f} tokens/forward, "
              f"prefill {done.prefill_tokens_per_second:.1f} tok/s, peak {done.peak_memory_bytes / 1e9:.2f} GB, "
              f"{done.precision}",
              file=sys.stderr)
    return 0


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
    try:
        precision = planned_precision(args)  # a model that does not fit is refused before the app starts
    except MemoryBudgetError:
        raise
    except DGemmaError:  # a file that cannot be read: the app says why and offers the demo
        if ranks:
            raise
        precision = args.precision
    if ranks and launched_rank() > 0:  # rank 0 owns the app; this rank runs its model calls
        return _follow_chat(args, precision)
    if ranks:
        with rank_terminal("chat"):
            return run_app(model=model, demo=args.demo, dtype=args.dtype, precision=precision,
                           think=args.think, system=args.system, memory_limit=memory_limit(args),
                           quality=args.quality)
    return run_app(model=model, demo=args.demo, dtype=args.dtype, precision=precision,
                   think=args.think, system=args.system, memory_limit=memory_limit(args), quality=args.quality)


def _follow_chat(args: argparse.Namespace, precision: str) -> int:
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
    run_follower(load_for_cli(args.model, args.demo, args.dtype, precision, memory_limit(args)), "chat")


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
    args.precision = planned_precision(args)  # refused before the server starts if it does not fit
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
        # the ranks' shares differ by a vocabulary row at most: show the largest
        plan = max((plan_model(args.model, limit, args.context, ranks=args.ranks, rank=r, machine=args.machine)
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
    c.add_argument("out_dir", help="output directory, created with its parents (must not exist unless --force)")
    from .tiers import TIER_HELP, TIERS

    form = c.add_mutually_exclusive_group()
    form.add_argument("--precision", choices=(*TIERS, "auto"), default="exact",
                      help="the weights' form on disk (default exact, bit for bit); a lossy one is smaller and is "
                           "what a small Mac loads without ever holding the exact form: "
                           + "; ".join(f"{k} = {v}" for k, v in TIER_HELP.items() if k != "exact")
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
