"""``mlx-dgemma doctor``: does this machine's MLX compute the model right?

Users of other DiffusionGemma ports report garbled text on Apple GPUs that was right on the
CPU (a Metal compiler bug in MLX's M5 matmul kernels; Metal async compute corrupting a prompt's
KV cache). ``doctor`` runs the model's own operations (the encoder's prefill, the compiled
denoising step, the sampler) on a fixed input on the default device and again on MLX's CPU
stream, and compares the prefill KV cache, the denoiser logits and the sampler's argmax
decisions against :data:`THRESHOLDS`. It also reports the device, MLX's version and backend,
the memory the GPU may use, which precision of a model fits, and the CUDA kernel cache.

Cases: the trained demo model; one decoder layer at the published shapes (random weights, fixed
seed, a short canvas); with a model path, that model's first layers. Where the default device
is the CPU, both runs are on the CPU (the compiled step against the eager one): they must agree
to float32 rounding, and the report says plainly that there is no GPU.

On a Mac's GPU the checks run with float32 matmuls kept IEEE float32, as ``exact`` runs them
(``MLX_ENABLE_TF32=0``, set before the first matmul: :mod:`mlx_dgemma.gpu`); the report says
whether the GPU has NAX units (M5-class, macOS 26.2+), which would otherwise run them at
reduced precision, and one more check (a float32 matmul against the CPU's) shows that they did
not. ``--report FILE`` writes everything, with the machine and timings, as one JSON file a user
attaches to an issue.

This module is the command (its arguments, the cases it runs, ``main``); the checks are
:mod:`mlx_dgemma.doctor_checks`', the machine's rows :mod:`mlx_dgemma.doctor_device`'s, the report
and ``--report``'s file :mod:`mlx_dgemma.doctor_report`'s. Their public names are importable from here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import mlx.core as mx
import numpy as np

from mlx_dgemma.doctor_checks import (  # noqa: F401 (re-exported: doctor's public names)
    CHECK_NAMES, FIXED_PROMPT, MATMUL_SHAPE, MATMUL_TOLERANCE, THRESHOLDS, CaseInput, Check, Perturb, RunOutputs,
    Tolerance, compare, decisive_positions, fixed_input, matmul_check, non_finite_weights, relative_error, run_model,
    subject_and_reference, tolerance)
from mlx_dgemma.doctor_device import (  # noqa: F401 (re-exported)
    FIT_PROMPT_TOKENS, DeviceInfo, Fit, KernelCache, MemoryInfo, PrecisionFit, backend_name, device_info,
    kernel_cache, precision_fit, usable_memory)
from mlx_dgemma.doctor_report import (  # noqa: F401 (re-exported)
    REPORT_DEMO_BLOCKS, REPORT_FORMAT, REPORT_MODEL_STEPS, Report, Timing, machine, report_document, time_answer,
    time_demo, time_first_layers, write_report)
from mlx_dgemma.errors import ParameterError, hold_interrupts
from mlx_dgemma.gpu import TF32_ENV, keep_float32_exact
from mlx_dgemma.paths import check_output_file

# --------------------------------------------------------------------------------------------
# the cases' models (the demo's is the loader's; --model's first layers: mlx_dgemma.loader.load_layers)

# One decoder layer at the published shapes (mlx_dgemma.bench.configs "real-shapes"): only the
# output head's vocabulary is cut (262,144 -> 4,096) and the canvas and prompt are short, so the
# CPU reference takes seconds; the layer itself (attention, dense MLP, 128 experts x 704, top 8)
# is full size.
LAYER_VOCAB = 4096
LAYER_CANVAS = 16
LAYER_PROMPT = 16


def real_shapes_layer(precision: str = "exact") -> tuple[Any, list[int], dict]:
    """(model, prompt ids, generation config): one sliding layer at the published shapes, random
    Q4_K_M weights (seed 0), built as a synthetic GGUF and converted in memory like a real one."""
    from mlx_dgemma.bench.configs import CONFIGS
    from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf

    from mlx_dgemma.loader import load

    spec = dict(CONFIGS["real-shapes"])
    spec.update(num_layers=1, global_layers=(), vocab_size=LAYER_VOCAB, canvas_length=LAYER_CANVAS)
    with tempfile.TemporaryDirectory(prefix="mlx-dgemma-doctor-") as d:
        gguf = write_tiny_gguf(Path(d) / "layer.gguf", TinySpec(**spec, context_length=65536), types="q4_k_m",
                               seed=0, weight_std=0.02)
        runtime = load(gguf, precision=precision)
    ids = np.random.default_rng(1).integers(0, LAYER_VOCAB, LAYER_PROMPT).tolist()
    return runtime.model, ids, runtime.generation_config


def _dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


# --------------------------------------------------------------------------------------------
# running it all

CASES = ("demo", "layer")  # and "model" with a path
DEFAULT_MODEL_LAYERS = 2
MODEL_CANVAS = 32  # a real model's canvas is 256; the first positions are enough to compare


def precisions_to_check(choice: str) -> list[str]:
    """"auto": exact, plus fast where its dtype differs from float32 (on a GPU); or one of them."""
    from mlx_dgemma.precision import fast_dtype

    if choice == "auto":
        return ["exact"] + (["fast"] if fast_dtype() != mx.float32 else [])
    if choice in ("exact", "fast"):
        return [choice]
    raise ParameterError(f"--precision {choice!r}: must be one of auto, exact, fast")


class Progress:
    """One stderr line per phase, with the time since the start."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0 = time.perf_counter()

    @contextmanager
    def phase(self, text: str) -> Iterator[None]:
        if self.enabled:
            self.stream.write(f"[doctor {time.perf_counter() - self.t0:6.1f}s] {text}...\n")
            self.stream.flush()
        yield


def run_doctor(model_path: str | None = None, *, cases: Sequence[str] = CASES, precision: str = "auto",
               layers: int = DEFAULT_MODEL_LAYERS, perturb: Perturb | None = None,
               progress: Progress | None = None, timed: bool = False) -> Report:
    """Everything ``mlx-dgemma doctor`` reports. ``perturb`` corrupts the default device's results
    before comparison (tests prove each check can fail); bad input raises before any work.
    ``timed``: also time a short answer on the demo (and the model's first layers) in each
    precision checked (:class:`Timing`, ``--report``)."""
    t0 = time.perf_counter()
    from mlx_dgemma.paths import check_model_path
    from mlx_dgemma.precision import apply_precision, resolve_precision
    from mlx_dgemma.sampler import SamplerParams

    prog = progress or Progress(enabled=False)
    if not isinstance(layers, int) or layers < 1:
        raise ParameterError(f"--layers {layers!r}: must be a whole number of layers >= 1")
    precs = precisions_to_check(precision)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ParameterError(f"doctor cases {sorted(unknown)}: expected some of {', '.join(CASES)}")
    path = None
    if model_path is not None:
        path = check_model_path(model_path, "--model")  # a FIFO, a device or a link loop named as such
    # exact's float32 stays IEEE on an M5-class GPU: set before the first matmul below (MLX reads it once)
    keep_float32_exact()
    # held: MLX's and the loader's imports (native inits lost or aborted on Ctrl+C); the rest reads
    # a header at most
    with prog.phase("device, memory" + (", which precision fits" if path is not None else "")), hold_interrupts():
        dev = device_info()
        mem = usable_memory()
        report = Report(dev, mem, kernel_cache(), None)
        if path is not None:
            report.fit = precision_fit(path, mem)

    def check_case(case: str, load: Callable[[str], tuple[Any, list[int], dict]], canvas: int | None) -> None:
        with prog.phase(f"{case}: loading"):
            model, ids, gen = load("exact")
        case = case.format(layers=model.args.num_hidden_layers)
        for prec in precs:  # exact first: fast is made from it in memory, as the loader does
            resolved = resolve_precision(prec)
            apply_precision(model, resolved)
            dtype = resolved.dtype
            label = f"{prec} ({_dtype_name(dtype)})"
            params = SamplerParams.from_config(gen)
            C = min(canvas or model.args.canvas_length, model.args.canvas_length)
            inp = fixed_input(model.args, ids, C, params.t_max)
            with prog.phase(f"{case}, {label}: prefill {len(ids)} tokens + one step of {C} on "
                            f"{'the GPU and ' if dev.gpu else ''}the CPU"):
                subject, reference = subject_and_reference(model, inp, dtype, params, resolved.sc_top_k)
            checks = compare(case, label, subject, reference, tolerance(dev.backend, _dtype_name(dtype)), perturb)
            if any(c.model_fault for c in checks):  # name the weights at fault, where some are
                bad = non_finite_weights(model)
                named = f"; NaN/Inf in its weights: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}" if bad else ""
                checks = [replace(c, detail=c.detail + named) if c.model_fault else c for c in checks]
            report.checks.extend(checks)

    def demo(prec: str):
        from mlx_dgemma.loader import load_demo

        runtime = load_demo(precision=prec)
        return runtime.model, runtime.tokenizer.encode(FIXED_PROMPT), runtime.generation_config

    if dev.backend == "metal" and "exact" in precs:
        with prog.phase("device: a float32 matmul on the GPU and the CPU"):
            report.checks.append(matmul_check(perturb))
    if "demo" in cases:
        check_case("demo", demo, None)
    if "layer" in cases:
        check_case("real-shapes layer", real_shapes_layer, LAYER_CANVAS)
    if path is not None:
        def first(prec: str):
            from mlx_dgemma.loader import load_layers
            from mlx_dgemma.progress import ProgressBar

            bar = ProgressBar("converting in memory", unit="tensors", scale=1) if prog.enabled else None
            runtime = load_layers(path, layers, prec, progress=bar.update if bar else None)
            return runtime.model, runtime.tokenizer.encode(FIXED_PROMPT), runtime.generation_config

        check_case(path.name.replace("{", "{{").replace("}", "}}") + " (first {layers} layers)", first,
                   MODEL_CANVAS)
    if timed:
        for prec in precs:
            with prog.phase(f"timing: demo, {prec}: load, then an answer of up to {REPORT_DEMO_BLOCKS} blocks"):
                report.timings.append(time_demo(prec))
            if path is not None:
                with prog.phase(f"timing: {path.name} (first {layers} layers), {prec}: load, then one block of "
                                f"at most {REPORT_MODEL_STEPS} steps"):
                    report.timings.append(time_first_layers(path, layers, prec))
    report.seconds = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------------------------
# the command


def add_args(p: Any) -> None:
    p.add_argument("--model", help="also check the first layers of this model (converted directory or .gguf)")
    p.add_argument("--layers", type=int, default=DEFAULT_MODEL_LAYERS,
                   help=f"how many of --model's first layers to run (default {DEFAULT_MODEL_LAYERS})")
    p.add_argument("--precision", choices=("auto", "exact", "fast"), default="auto",
                   help="which runtime precision to check: auto (default) = exact, plus fast on a GPU")
    p.add_argument("--quick", action="store_true",
                   help="skip the real-shapes layer (the slow case on a CPU: tens of seconds); the demo "
                        "and --model still run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--report", metavar="FILE",
                   help="also write one JSON file to attach to an issue: the machine (chip, RAM, macOS, Python, "
                        "MLX), the plan for --model, the checks, and load time, prefill tok/s, s/step and answer "
                        "tok/s on the demo (and on --model's first layers)")


def main(args: Any, perturb: Perturb | None = None, out: TextIO | None = None) -> int:
    """``mlx-dgemma doctor``: exit 0 when every check agrees, 1 when any fails (named).
    ``--report FILE`` is written either way (a failing machine's report is the one wanted)."""
    out = out or sys.stdout
    report_path = None
    if getattr(args, "report", None) is not None:  # refused before any check: unwritable, empty, an input
        from mlx_dgemma.demo import trained_demo_path

        report_path = check_output_file(args.report, "--report", [args.model, trained_demo_path()],
                                        example="doctor-report.json")
    tf32_env = os.environ.get(TF32_ENV)  # as the user started the process (doctor sets it for exact)
    cases = ("demo",) if args.quick else CASES
    report = run_doctor(args.model, cases=cases, precision=args.precision, layers=args.layers, perturb=perturb,
                        progress=Progress(), timed=report_path is not None)
    if args.json:
        out.write(json.dumps(report.to_json()) + "\n")
    else:
        out.write("\n".join(report.lines()) + "\n")
    if report_path is not None:
        write_report(report_path, report_document(report, args.model, tf32_env))
        print(f"[doctor] report written to {report_path.given}: attach it to your issue", file=sys.stderr)
    return report.exit_code
