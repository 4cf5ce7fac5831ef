"""``mlx-dgemma bench --e2e``: answer tokens per second as a user feels them, ours against
mlx-vlm's DiffusionGemma in one run, on trained weights (the built-in demo by default).

Each implementation runs its OWN generation loop with its own default sampler on the same
weights, prompts (rendered by our chat template into the same token ids) and seeds:

* ``mlx-dgemma``: ``stream_generate`` with the model's generation_config (EntropyBound);
* ``mlx-vlm``: ``mlx_vlm.generate.diffusion.stream_diffusion_generate`` (what its
  ``Model.generate`` and CLI run) with its defaults: confidence-threshold acceptance at 0.9,
  argmax draws (temperature 0), eager (its ``diffusion_compile`` is off by default), fed our
  generation_config's values (temperature schedule, entropy bound, stopping rule, EOS ids).
  Its weights are the file's, dequantized, then quantized by mlx-vlm's own ``nn.quantize``
  with its predicate at 8 bits, groups of 64 (its default group size): quantized against
  quantized, as users run both (ours runs the file's 8-bit blocks, groups of 32, for the demo).
  On MLX's CPU backend an 8-bit ``quantized_matmul`` costs 1.4-2.0x a dense float32 matmul
  at the demo's shapes, so the dense float32 row is kept as a reference only;

and, for the gap at equal samplers, mlx-vlm with its ``entropy-bound`` sampler and ours with
``accept_probability=0.9`` (mlx-vlm's confidence threshold). Every row is one isolated process
(``isolate.isolated``), with one untimed warm-up answer first (tracing, kernel caches).

Definitions (the same for every row):

* answer tokens: the generated tokens up to the end of the turn, i.e. before the first EOS id
  of the generation config (``<eos>``, ``<turn|>``, ...), which is not counted;
* wall: from the call to the last token, prefill included; answer tokens/s = sum of answer
  tokens / sum of wall over the prompts;
* steps: decoder passes; s/step = (wall - prefill) / steps (committing a block through the
  encoder included, for both); tokens per forward = answer tokens / steps;
* time to first block: from the call to the first committed block (prefill included);
* prefill tok/s: prompt tokens / prefill seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mlx_dgemma.params import quality_of
from mlx_dgemma.request import GenerationRequest

from .isolate import isolated
from .report import machine
from .timing import log

# Short prompts in the demo's register (a verse to continue) and free questions.
PROMPTS = ("In the beginning God created the heaven and the earth.", "The Lord is my shepherd",
           "Tell me about the sea.", "And the king said unto Daniel,", "Blessed are the meek:",
           "Who made the stars?", "And Moses went up unto the mountain.", "What is wisdom?")
WARMUP_PROMPT = "Hello! Who are you?"
MLX_VLM_THRESHOLD = 0.9  # mlx_vlm.generate.diffusion.DEFAULT_DIFFUSION_CONFIDENCE_THRESHOLD


def sampler_label(mode: Any, value: float | None) -> str:
    """A row's sampler in the words of its acceptance mode (:mod:`mlx_dgemma.acceptance`): the
    mode's label, and the value of the parameter that selects it."""
    return mode.label if value is None else f"{mode.label} {value}"


def _answer_tokens(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """The tokens up to the end of the turn (the first EOS id, not included)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def _prompt_ids(tokenizer: Any, text: str) -> list[int]:
    from mlx_dgemma.chat_template import render_chat

    return tokenizer.encode(render_chat([{"role": "user", "content": text}], tokenizer.chat_template))


def _summary(impl: str, sampler: str, runs: list[dict]) -> dict:
    """One table row from per-prompt runs (see the module docstring for the definitions)."""
    blocks = [s for r in runs for s in r["steps_per_block"]]
    steps = sum(blocks)
    wall = sum(r["wall_s"] for r in runs)
    answer = sum(len(r["answer_ids"]) for r in runs)
    prefill_s = sum(r["prefill_s"] for r in runs)
    return {"impl": impl, "sampler": sampler, "prompts": len(runs), "answer_tokens": answer, "wall_s": wall,
            "answer_tokens_per_s": answer / wall if wall else 0.0,
            "steps": steps, "blocks": len(blocks),
            "mean_steps_per_block": steps / len(blocks) if blocks else 0.0,
            "median_steps_per_block": statistics.median(blocks) if blocks else 0.0,
            "s_per_step": (wall - prefill_s) / steps if steps else 0.0,
            "tokens_per_forward": answer / steps if steps else 0.0,
            "median_first_block_s": statistics.median(r["first_block_s"] for r in runs),
            "prefill_tokens_per_s": sum(r["prompt_tokens"] for r in runs) / prefill_s if prefill_s else 0.0,
            "runs": runs}


def _ours_answerer(model: str, precision: str = "auto", overrides: dict | None = None,
                   label: str = "mlx-dgemma") -> tuple[str, str, Any]:
    """(impl label, sampler label, answer(text, seed) -> run dict) for our ``stream_generate``."""
    from mlx_dgemma import load
    from mlx_dgemma.acceptance import acceptance_of
    from mlx_dgemma.events import BlockEvent, DoneEvent, PrefillEvent
    from mlx_dgemma.generation import stream_generate
    from mlx_dgemma.sampler import SamplerParams

    rt = load(model, precision=precision)
    tok = rt.tokenizer
    overrides = dict(overrides or {})
    params = SamplerParams.from_config(rt.generation_config, **overrides)
    eos = params.eos_token_id
    mode = type(acceptance_of(params))  # the row is labelled by the mode the step runs
    sampler = sampler_label(mode, getattr(params, mode.param) if mode.param else None)
    dial = quality_of(overrides)
    if dial is not None and dial != "max":  # a setting of the speed/quality dial: say which
        sampler += f" (--quality {dial})"

    def answer(text: str, seed: int) -> dict:
        ids = _prompt_ids(tok, text)
        t0 = time.perf_counter()
        first = prefill = None
        done = None
        for ev in stream_generate(rt, ids, seed=seed, **overrides):
            if isinstance(ev, PrefillEvent):
                prefill = ev.seconds
            elif isinstance(ev, BlockEvent) and first is None:
                first = time.perf_counter() - t0
            elif isinstance(ev, DoneEvent):
                done = ev
        wall = time.perf_counter() - t0
        assert done is not None and prefill is not None
        ans = _answer_tokens(list(done.tokens), eos)
        log(f"{label}: {text[:30]!r}: {len(ans)} tokens, steps {list(done.steps_per_block)}, {wall:.1f} s")
        return {"prompt": text, "seed": seed, "prompt_tokens": len(ids), "answer_ids": ans,
                "answer": tok.decode(ans), "wall_s": wall, "prefill_s": prefill,
                "first_block_s": first if first is not None else wall,
                "steps_per_block": list(done.steps_per_block)}

    return f"{label} {rt.precision.label}", sampler, answer


def e2e_ours(model: str, prompts: list[str], seeds: list[int], label: str = "mlx-dgemma",
             precision: str = "auto", overrides: dict | None = None, warmup: bool = True) -> dict:
    """Our ``stream_generate`` on each prompt (one isolated measurement)."""
    impl, sampler, answer = _ours_answerer(model, precision, overrides, label)
    if warmup:
        answer(WARMUP_PROMPT, 0)
    return _summary(impl, sampler, [answer(text, seed) for text, seed in zip(prompts, seeds)])


class _Detokenizer:
    """The streaming detokenizer mlx-vlm's loop feeds token by token: collects the ids only
    (the text is decoded once afterwards, outside the timed loop; ours decodes per block)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.tokens = []

    def add_token(self, token: int, skip_special_token_ids: Any = None) -> None:
        self.tokens.append(token)

    @property
    def last_segment(self) -> str:
        return ""

    def finalize(self) -> None:
        pass


class _Stopping:
    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = set(ids)

    def add_eos_token_ids(self, ids: Any) -> None:
        self.ids |= set([ids] if isinstance(ids, int) else ids)

    def __call__(self, token: int) -> bool:
        return token in self.ids


class _Processor:
    """What mlx-vlm's loop asks of its processor/tokenizer: a detokenizer and a stop test."""

    def __init__(self, eos: tuple[int, ...]) -> None:
        self.detokenizer = _Detokenizer()
        self.stopping_criteria = _Stopping(eos)


def mlx_vlm_generation_config(gc: dict) -> dict:
    """Our generation_config in the layout mlx-vlm's loop reads (``model.config.generation_config``)."""
    from mlx_dgemma.sampler import SamplerParams

    p = SamplerParams.from_config(gc)
    return {"max_denoising_steps": p.max_denoising_steps, "max_new_tokens": p.max_new_tokens,
            "eos_token_id": list(p.eos_token_id), "t_min": p.t_min, "t_max": p.t_max,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": p.entropy_bound},
            "diffusion_stopping_config": {"stability_threshold": p.stability_threshold,
                                          "confidence_threshold": p.confidence_threshold}}


MLX_VLM_BITS, MLX_VLM_GROUP = 8, 64  # the fair rows' quantization (mlx-vlm's own, its default group size)


def _mlx_vlm_answerer(model: str, sampler: str = "confidence-threshold",
                     overrides: dict | None = None, bits: int | None = MLX_VLM_BITS) -> tuple[str, str, Any]:
    """(impl label, sampler label, answer(text, seed) -> run dict) for mlx-vlm's own loop
    (``stream_diffusion_generate``) on the GGUF's weights, quantized by mlx-vlm at ``bits``
    (groups of MLX_VLM_GROUP; None: dense float32, the reference row), with its defaults
    except the ``diffusion_sampler``. ``overrides``: generation_config values for both loops."""
    import mlx.core as mx
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    from mlx_dgemma import load
    from mlx_dgemma.acceptance import ConfidenceThreshold, EntropyBound

    from .peers import mlx_vlm_model_from_gguf

    ours = load(model)  # our tokenizer and the file's generation config (same ids as ours)
    tok = ours.tokenizer
    gc = {**ours.generation_config, **{k: v for k, v in (overrides or {}).items() if k != "accept_probability"}}
    del ours
    vlm = mlx_vlm_model_from_gguf(Path(model), dtype=mx.float32, quantize_bits=bits, group_size=MLX_VLM_GROUP)
    vlm.config.generation_config = mlx_vlm_generation_config(gc)
    eos = tuple(vlm.config.generation_config["eos_token_id"])
    max_tokens = vlm.config.generation_config["max_new_tokens"]

    def answer(text: str, seed: int) -> dict:
        ids = _prompt_ids(tok, text)
        mx.random.seed(seed)  # what its CLI and server do with a seed
        proc = _Processor(eos)
        t0 = time.perf_counter()
        first, tokens, block_steps, last = None, [], [], None
        for r in stream_diffusion_generate(vlm, proc, proc, mx.array([ids], dtype=mx.int32), None, None,
                                           max_tokens=max_tokens, skip_special_token_ids=[],
                                           diffusion_sampler=sampler):
            last = r
            if r.diffusion_block_complete:
                if first is None:
                    first = time.perf_counter() - t0
                block_steps.append(r.diffusion_denoising_steps - sum(block_steps))
            elif r.token is not None and not r.is_draft and r.finish_reason is None:
                tokens.append(int(r.token))
        wall = time.perf_counter() - t0
        prefill = last.prompt_tokens / last.prompt_tps
        log(f"mlx-vlm {sampler}: {text[:30]!r}: {len(tokens)} tokens, steps {block_steps}, {wall:.1f} s")
        return {"prompt": text, "seed": seed, "prompt_tokens": len(ids), "answer_ids": tokens,
                "answer": tok.decode(tokens), "wall_s": wall, "prefill_s": prefill,
                "first_block_s": first if first is not None else wall, "steps_per_block": block_steps}

    label = sampler_label(ConfidenceThreshold, MLX_VLM_THRESHOLD) if sampler == "confidence-threshold" \
        else sampler_label(EntropyBound, None)
    form = "dense f32, reference" if bits is None else f"{bits}-bit g{MLX_VLM_GROUP}, its own quant."
    return f"mlx-vlm ({form})", label, answer


def e2e_mlx_vlm(model: str, prompts: list[str], seeds: list[int], sampler: str = "confidence-threshold",
                warmup: bool = True, overrides: dict | None = None, bits: int | None = MLX_VLM_BITS) -> dict:
    """mlx-vlm's own generation loop on each prompt (one isolated measurement); see
    :func:`_mlx_vlm_answerer`."""
    impl, label, answer = _mlx_vlm_answerer(model, sampler, overrides, bits)
    if warmup:
        answer(WARMUP_PROMPT, 0)
    return _summary(impl, label, [answer(text, seed) for text, seed in zip(prompts, seeds)])


# A row's answerer in a long-lived process (``--e2e-interleave``): loads once, warms up, then
# answers one prompt per request, so the rows can take turns prompt by prompt.
ANSWERERS = {"mlx_dgemma.bench.e2e:e2e_ours": "_ours_answerer", "mlx_dgemma.bench.e2e:e2e_mlx_vlm": "_mlx_vlm_answerer"}


def _worker(conn: Any, target: str, kw: dict) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers
    try:
        impl, sampler, answer = globals()[ANSWERERS[target]](kw.pop("model"), **kw)
        answer(WARMUP_PROMPT, 0)
        conn.send(("ready", (impl, sampler)))
        while True:
            msg = conn.recv()
            if msg is None:
                return
            conn.send(("ok", answer(*msg)))
    except Exception as e:  # reported in the table, the run goes on
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _run_interleaved(model: str, prompts: list[str], seeds: list[int], rows: tuple,
                     overrides: dict | None) -> dict[str, dict]:
    """Every row in its own long-lived process; prompt by prompt, each row answers in turn, so a
    shared machine's changing load hits every row alike (``run_e2e(interleave=True)``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    workers: dict[str, tuple] = {}
    out: dict[str, dict] = {}
    try:
        for name, target, kw in rows:
            kw = {**kw, "overrides": {**(overrides or {}), **kw.get("overrides", {})}, "model": model}
            kw.pop("warmup", None)
            if target.endswith("e2e_mlx_vlm"):
                kw = {k: v for k, v in kw.items() if k in ("model", "sampler", "overrides", "bits")}
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, target, kw))
            proc.start()
            child.close()
            workers[name] = (proc, parent)
        labels, runs = {}, {name: [] for name in workers}
        for name, (proc, conn) in workers.items():
            status, res = conn.recv()
            if status == "ready":
                labels[name] = res
            else:
                out[name] = {"impl": name, "skipped": res}
        for text, seed in zip(prompts, seeds):
            for name in labels:
                if name in out:
                    continue
                conn = workers[name][1]
                conn.send((text, seed))
                status, res = conn.recv()
                if status == "ok":
                    runs[name].append(res)
                else:
                    out[name] = {"impl": name, "skipped": res}
        for name, (impl, sampler) in labels.items():
            out.setdefault(name, _summary(impl, sampler, runs[name]))
    finally:
        for proc, conn in workers.values():
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {name: out[name] for name, _, _ in rows if name in out}


# (name, target, kwargs beyond model/prompts/seeds): ours and the peer (quantized, like ours)
# each with its default sampler first, then each with the other's; last the peer dense in
# float32 with its default, as a reference (not like with like: see the module docstring).
ROWS = (
    ("ours-default", "mlx_dgemma.bench.e2e:e2e_ours", {}),
    ("mlx-vlm-default", "mlx_dgemma.bench.e2e:e2e_mlx_vlm", {"sampler": "confidence-threshold"}),
    ("mlx-vlm-entropy-bound", "mlx_dgemma.bench.e2e:e2e_mlx_vlm", {"sampler": "entropy-bound"}),
    ("ours-confidence", "mlx_dgemma.bench.e2e:e2e_ours", {"overrides": {"accept_probability": MLX_VLM_THRESHOLD}}),
    # the dial's middle setting (--quality balanced: EntropyBound, stop on mean entropy alone)
    ("ours-balanced", "mlx_dgemma.bench.e2e:e2e_ours", {"overrides": GenerationRequest.of(quality="balanced").params}),
    ("mlx-vlm-dense-default", "mlx_dgemma.bench.e2e:e2e_mlx_vlm", {"sampler": "confidence-threshold", "bits": None}),
)
# (key, numerator row, denominator row, what the ratio compares)
RATIOS = (
    ("ours_vs_mlx_vlm_defaults", "ours-default", "mlx-vlm-default",
     "ours / mlx-vlm (both quantized), each with its default sampler"),
    ("ours_vs_mlx_vlm_entropy_bound", "ours-default", "mlx-vlm-entropy-bound",
     "ours / mlx-vlm (both quantized), both EntropyBound"),
    ("ours_vs_mlx_vlm_confidence", "ours-confidence", "mlx-vlm-default",
     "ours / mlx-vlm (both quantized), both confidence threshold"),
    ("ours_balanced_vs_mlx_vlm_default", "ours-balanced", "mlx-vlm-default",
     "ours --quality balanced / mlx-vlm (both quantized) with its default sampler"),
    ("ours_vs_mlx_vlm_dense_defaults", "ours-default", "mlx-vlm-dense-default",
     "ours / mlx-vlm dense float32 (reference), each with its default sampler"),
)


def run_e2e(models: list[str], prompts: list[str], seeds: list[int], rows: tuple = ROWS,
            timeout: float | None = None, overrides: dict | None = None, interleave: bool = False) -> dict:
    """Every row on every model, each isolated; JSON-ready. ``overrides``: generation_config
    values for every row (a row's own, such as ``accept_probability``, win). ``interleave``:
    the rows take turns prompt by prompt (each in its own long-lived process) instead of one
    row after the other, for a machine whose load changes during the run."""
    result: dict[str, Any] = {"machine": machine(), "prompts": prompts, "seeds": seeds, "models": {},
                              "interleaved": interleave}
    for model in models:
        entry: dict[str, Any] = {}
        if interleave:
            log(f"e2e {Path(model).name}: {len(rows)} rows, interleaved prompt by prompt")
            entry.update(_run_interleaved(model, prompts, seeds, rows, overrides))
        for name, target, kw in rows if not interleave else ():
            log(f"e2e {Path(model).name}: {name}")
            kw = {**kw, "overrides": {**(overrides or {}), **kw.get("overrides", {})}}
            entry[name] = isolated(target, timeout=timeout, model=model, prompts=prompts, seeds=seeds, **kw)
            entry[name].setdefault("impl", name)
        for key, num, den, _ in RATIOS:
            a, b = entry.get(num, {}).get("answer_tokens_per_s"), entry.get(den, {}).get("answer_tokens_per_s")
            if a and b:
                entry[key] = a / b
        result["models"][model] = entry
    return result


def e2e_table(result: dict) -> str:
    """The human-readable table of :func:`run_e2e`'s result."""
    lines = [f"machine: {result['machine']['platform']} ({result['machine']['device']}, "
             f"mlx {result['machine']['mlx']}); {len(result['prompts'])} prompts"]
    rows = [r for entry in result["models"].values() for r in entry.values() if isinstance(r, dict)]
    iw = max([42, *(len(r.get("impl", "")) for r in rows)])  # the columns as wide as their longest label
    sw = max([24, *(len(r.get("sampler", "")) for r in rows)])
    head = (f"{'implementation':<{iw}} {'sampler':<{sw}} {'ans tok/s':>9} {'steps/blk':>9} {'s/step':>7} "
            f"{'tok/fwd':>7} {'1st blk s':>9} {'prefill tok/s':>13} {'ans tok':>7}")
    for model, entry in result["models"].items():
        lines += ["", f"## {Path(model).name}", head]
        for name, r in entry.items():
            if not isinstance(r, dict):
                continue
            if "skipped" in r:
                lines.append(f"{r['impl']:<{iw}} skipped: {r['skipped']}")
                continue
            lines.append(f"{r['impl']:<{iw}} {r['sampler']:<{sw}} {r['answer_tokens_per_s']:>9.2f} "
                         f"{r['mean_steps_per_block']:>9.1f} {r['s_per_step']:>7.3f} {r['tokens_per_forward']:>7.2f} "
                         f"{r['median_first_block_s']:>9.2f} {r['prefill_tokens_per_s']:>13.1f} "
                         f"{r['answer_tokens']:>7}")
        for key, _, _, text in RATIOS:
            if key in entry:
                lines.append(f"{text}: {entry[key]:.2f}x answer tokens/s (above 1: ours faster)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``mlx-dgemma bench --e2e``: run, print the table, write the JSON."""
    from mlx_dgemma.demo import demo_file
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.paths import check_output_file, open_output

    models = [m.strip() for m in (args.e2e_models or "").split(",") if m.strip()] or [str(demo_file())]
    for m in models:
        if not Path(m).exists():
            raise ParameterError(f"--e2e-models: {m}: no such file; give GGUF files (default: the trained demo)")
    if not 1 <= args.e2e_prompts <= len(PROMPTS):
        raise ParameterError(f"--e2e-prompts {args.e2e_prompts}: must be in [1, {len(PROMPTS)}]")
    prompts = list(PROMPTS[: args.e2e_prompts])
    out = check_output_file(args.json, "--json", models, example="e2e.json")  # never over a model it runs
    result = run_e2e(models, prompts, list(range(len(prompts))), timeout=args.child_timeout,
                     interleave=getattr(args, "e2e_interleave", False))
    print(e2e_table(result))
    with open_output(out) as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0
