"""What ``mlx-dgemma doctor`` reports: :class:`Report` (its text lines and ``--json``'s
object), the timed answers of ``--report FILE`` (:class:`Timing`) and that file's document (the
machine, the plan for the model, the checks, the timings), written whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dgemma.doctor_checks import FIXED_PROMPT, Check
from mlx_dgemma.doctor_device import FIT_PROMPT_TOKENS, DeviceInfo, Fit, KernelCache, MemoryInfo
from mlx_dgemma.gpu import TF32_ENV
from mlx_dgemma.memory import gb
from mlx_dgemma.paths import OutputFile, open_output
from mlx_dgemma.rss import physical_ram_bytes

# --------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class Timing:
    """One short answer, timed as a user's start would be (``--report``): the load in that
    precision, then :func:`mlx_dgemma.generation.stream_generate` on a fixed prompt, seed 0."""

    case: str
    precision: str
    load_seconds: float
    prompt_tokens: int
    prefill_tokens_per_second: float
    steps: int
    seconds_per_step: float
    answer_tokens: int  # before the end-of-turn marker, padding left out
    answer_tokens_per_second: float  # answer tokens / the denoising time
    tokens_per_forward: float
    peak_memory_bytes: int


@dataclass
class Report:
    device: DeviceInfo
    memory: MemoryInfo
    kernel_cache: KernelCache
    fit: Fit | None
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    timings: list[Timing] = field(default_factory=list)  # --report only

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def provisional(self) -> bool:
        """Any threshold used is a derived bound not yet measured on a good machine."""
        return any(c.provisional for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "exit_code": self.exit_code,
            "device": asdict(self.device), "memory": asdict(self.memory), "kernel_cache": asdict(self.kernel_cache),
            "fit": None if self.fit is None else asdict(self.fit),
            "thresholds_provisional": self.provisional,
            "checks": [{**asdict(c), "value": _json_float(c.value), "label": c.label} for c in self.checks],
            "failed": [c.label for c in self.failed],
            "seconds": round(self.seconds, 2),
        }

    def lines(self) -> list[str]:
        d, m, k = self.device, self.memory, self.kernel_cache
        out = [f"device:        {'GPU' if d.gpu else 'CPU'} ({d.name}); MLX {d.mlx_version}, backend {d.backend}"]
        if not d.gpu:
            out.append("               no GPU: MLX's default device is the CPU, so the checks compare the CPU "
                       "with itself (compiled vs eager step); a GPU's kernels were not checked")
        if d.backend == "metal":
            out.append(f"matmul units:  NAX ({d.architecture}, macOS 26.2+): float32 matmuls would run at "
                       f"reduced precision; exact and these checks keep them float32 ({TF32_ENV}=0)" if d.nax else
                       f"matmul units:  no NAX ({d.architecture or 'unknown'}): float32 matmuls are IEEE float32")
        out.append(f"memory:        {m.kind}: {'unknown' if m.bytes is None else gb(m.bytes)}"
                   + (f" ({m.note})" if m.note else ""))
        out.append("kernel cache:  " + (f"{k.dir}: {k.files} files, {gb(k.bytes)}; {k.note}" if k.applies
                                        else f"n/a ({k.note})"))
        if self.fit is None:
            out.append("fits:          give --model PATH to see which precision of a model fits")
        else:
            f = self.fit
            verdict = {True: "fits", False: "does NOT fit", None: "needs"}
            parts = [f"{p.precision} {verdict[p.fits]} ({gb(p.needed_bytes)})" for p in f.precisions]
            out.append(f"fits:          {'; '.join(parts)}; {f.available_kind} "
                       f"{'unknown' if f.available_bytes is None else gb(f.available_bytes)} "
                       f"(weights {gb(f.weights_bytes)} + a {FIT_PROMPT_TOKENS}-token prompt and one canvas)")
        out.append(f"checks:        {'default device vs' if d.gpu else 'compiled step vs'} MLX's CPU stream "
                   f"(eager), on a fixed input")
        for c in self.checks:
            v = f"{c.value:.1%} agree (min {c.threshold:.0%})" if c.check == "argmax" else \
                f"rel. error {c.value:.2e} (max {c.threshold:.0e})"
            out.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.label}: {v}" + (f"; {c.detail}" if c.detail else ""))
        if self.provisional:
            out.append("thresholds:    provisional (derived from rounding bounds, not yet measured on a good GPU)")
        for t in self.timings:
            out.append(f"timing:        {t.case}, {t.precision}: load {t.load_seconds:.2f} s, prefill "
                       f"{t.prefill_tokens_per_second:.1f} tok/s, {t.seconds_per_step:.3f} s/step, "
                       f"{t.answer_tokens_per_second:.1f} answer tok/s ({t.answer_tokens} tokens, {t.steps} steps)")
        if self.ok:
            out.append(f"result:        all {len(self.checks)} checks agree ({self.seconds:.1f} s)")
        else:
            model = [c.label for c in self.failed if c.model_fault]
            device = [c.label for c in self.failed if not c.model_fault]
            verdicts = []
            if model:
                verdicts.append("; ".join(model) + ": the model gives NaN or Inf on MLX's CPU as well, so its "
                                "weights are broken, not this device (mlx-dgemma verify DIR GGUF names the tensors "
                                "of a converted directory; else download the model again)")
            if device:
                verdicts.append("; ".join(device) + ": this device computes the model wrongly at the failing "
                                "precision: if only fast fails, run with --precision exact; either way, report "
                                "this output (README: Checking your machine)")
            out.append(f"result:        {len(self.failed)} of {len(self.checks)} checks FAILED: "
                       + ". ".join(verdicts))
        return out


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "nan")


# --------------------------------------------------------------------------------------------
# timings (--report): what a user's start and answer cost on this machine

REPORT_DEMO_BLOCKS = 2  # the demo's answer: up to 2 canvases (128 tokens), its own steps
REPORT_MODEL_STEPS = 8  # a model's first layers: one canvas, at most 8 steps (its head is full size)


def time_answer(case: str, runtime: Any, load_seconds: float, **params: Any) -> Timing:
    """Answer :data:`FIXED_PROMPT` (seed 0) with ``runtime``; the answer's figures."""
    from mlx_dgemma.events import DoneEvent
    from mlx_dgemma.generation import stream_generate
    from mlx_dgemma.sampler import SamplerParams

    done = None
    for ev in stream_generate(runtime, FIXED_PROMPT, seed=0, **params):
        if isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    p = SamplerParams.from_config(runtime.generation_config, **params)
    answer = []
    for t in done.tokens:
        if t in p.eos_token_id:
            break
        if t != p.pad_token_id:
            answer.append(t)
    gen_s = done.generation_seconds
    return Timing(case, runtime.precision.label, load_seconds, done.prompt_tokens, done.prefill_tokens_per_second,
                  done.steps, done.seconds_per_step, len(answer), len(answer) / gen_s if gen_s > 0 else 0.0,
                  done.tokens_per_forward, done.peak_memory_bytes)


def time_demo(precision: str) -> Timing:
    """The trained demo loaded in ``precision`` (as ``--demo`` loads it), then an answer."""
    from mlx_dgemma.loader import load_demo

    t0 = time.perf_counter()
    runtime = load_demo(precision=precision)
    load_s = time.perf_counter() - t0
    return time_answer("demo", runtime, load_s, max_new_tokens=REPORT_DEMO_BLOCKS * runtime.model.args.canvas_length)


def time_first_layers(path: Path, layers: int, precision: str) -> Timing:
    """The first ``layers`` layers of the model at ``path`` (:func:`mlx_dgemma.loader.load_layers`)
    in ``precision``, then one canvas of at most :data:`REPORT_MODEL_STEPS` steps (the text means
    nothing: the figures are the point)."""
    from mlx_dgemma.loader import load_layers

    t0 = time.perf_counter()
    runtime = load_layers(path, layers, precision)
    load_s = time.perf_counter() - t0
    args, gen = runtime.model.args, runtime.generation_config
    steps = min(REPORT_MODEL_STEPS, int(gen.get("max_denoising_steps", REPORT_MODEL_STEPS)))
    return time_answer(f"{path.name} (first {args.num_hidden_layers} layers)", runtime, load_s,
                       max_new_tokens=args.canvas_length, max_denoising_steps=steps)

# --------------------------------------------------------------------------------------------
# --report FILE: one JSON file a user attaches to an issue

REPORT_FORMAT = 1  # raised when a field changes meaning


def _chip() -> str:
    """The processor's name: "Apple M5 Pro" on a Mac (sysctl), the CPU model elsewhere."""
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            return platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def machine(tf32_env: str | None = None) -> dict[str, Any]:
    """The machine a report describes: chip, RAM, operating system, Python, MLX (and the
    ``MLX_ENABLE_TF32`` the process was started with, ``tf32_env``)."""
    from mlx_dgemma import __version__

    mac = platform.mac_ver()[0]
    return {"chip": _chip(), "ram_bytes": physical_ram_bytes() or None,  # None: unknown
            "os": f"macOS {mac}" if mac else platform.platform(),
            "arch": platform.machine(), "cpus": os.cpu_count(),
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "mlx": mx.__version__, "mlx_dgemma": __version__, TF32_ENV: tf32_env}


def report_document(report: Report, model_path: str | None, tf32_env: str | None) -> dict[str, Any]:
    """What ``--report FILE`` holds: the machine, the plan for ``model_path`` (as ``mlx-dgemma
    plan`` prints it), ``--json``'s report (device, memory, fit, checks) and the timings."""
    plan = None
    if model_path is not None:
        from mlx_dgemma.loader import plan_model

        plan = plan_model(model_path).to_dict()
    return {"format": REPORT_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(tf32_env), "plan": plan, **report.to_json(),
            "timings": [asdict(t) for t in report.timings]}


def write_report(out: OutputFile, document: dict[str, Any]) -> None:
    """Write the report whole, or nothing (as every output file: :func:`mlx_dgemma.paths.open_output`)."""
    with open_output(out) as f:
        f.write(json.dumps(document, indent=2) + "\n")
