"""``mlx-dgemma generate``: one answer, streamed to stdout (progress and timings on stderr).

The prompt's sources (``--prompt``, ``--prompt-file``, stdin), the step line on a terminal and the
command itself; its flags are built by ``mlx_dgemma.cli``, which runs :func:`main`. Standard
library only at the top: MLX, the tokenizer and the model are imported inside :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from .cli_options import flag_errors, flagged, load_for_cli, memory_limit, sampler_overrides
from .errors import hold_interrupts
from .params import flags  # generation parameter -> its flag (standard library only)

if TYPE_CHECKING:
    from .events import StepEvent


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


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-dgemma generate`` with its parsed ``args``; the exit status."""
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
        from .events import BlockEvent, DoneEvent, PrefillEvent, Stats, StepEvent
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
    # the summary's figures, folded from the events as the chat app and the server fold theirs (a new
    # statistic: its Stats property and the line that shows it)
    stats = Stats(pad_id=params.pad_token_id)
    try:  # the step line is erased however the loop ends (Ctrl+C, an error): not left on the terminal
        for ev in flagged(stream_generate(runtime, prompt, request=request, generation_config=gen_cfg,
                                          enable_thinking=args.think, chat=not args.raw), request.params):
            stats.add(ev)
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
    summary = {"finish_reason": done.finish_reason, "prompt_tokens": stats.prompt_tokens,
               "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2),
               "steps": stats.steps, "steps_per_block": list(stats.steps_per_block),
               "seconds_per_step": round(stats.seconds_per_step, 4),
               "tokens_per_forward": round(stats.tokens_per_forward, 3),
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
        print(f"[done] {done.finish_reason}; {stats.steps} steps {list(stats.steps_per_block)}, "
              f"{stats.seconds_per_step:.3f} s/step, {stats.tokens_per_forward:.2f} tokens/forward, "
              f"prefill {stats.prefill_tokens_per_second:.1f} tok/s, peak {done.peak_memory_bytes / 1e9:.2f} GB, "
              f"{done.precision}",
              file=sys.stderr)
    return 0
