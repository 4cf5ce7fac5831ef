"""The bench's report: the machine a run measured, and the table printed from its result."""

from __future__ import annotations

import os
import platform
import sys

import mlx.core as mx


def machine() -> dict:
    """The machine a run measured: platform, processor, Python, MLX and its device, CPUs."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "mlx": mx.__version__, "device": str(mx.default_device()),
            "cpus": os.cpu_count()}


NAME_WIDTH = 36  # the implementation column's least width; a longer name widens the whole column


def row_line(r: dict, width: int = NAME_WIDTH) -> str:
    """One row of the table: a measurement, or why it was skipped (also logged as it finishes)."""
    if "skipped" in r:
        return f"{r['impl']:<{width}} skipped: {r['skipped']}"
    peak = f"{r['peak_rss_bytes'] / 1e9:.2f}" if r.get("peak_rss_bytes") else "-"
    mpeak = f"{r['mlx_peak_bytes'] / 1e9:.2f}" if r.get("mlx_peak_bytes") else "-"
    return (f"{r['impl']:<{width}} {r['seconds_per_step'] * 1e3:>9.1f} "
            f"{r['prefill_tokens_per_second']:>13.1f} {peak:>11} {mpeak:>11}")


def ratio_line(impl: str, vs: dict[str, float]) -> str:
    """Our time per step as a multiple of each peer's, said in words (a bare "1.15x" was read
    as a speed-up)."""
    return f"{impl}, time per step: " + ", ".join(
        f"{v:.2f}x {k}'s ({'slower' if v > 1 else 'faster' if v < 1 else 'the same'})" for k, v in vs.items())


def table(result: dict) -> str:
    """The human-readable report of :func:`mlx_dgemma.bench.run`'s result (the JSON holds the rest)."""
    lines = [f"machine: {result['machine']['platform']} ({result['machine']['device']}, mlx {result['machine']['mlx']})"
             + ("  (interrupted: what had finished)" if result.get("interrupted") else ""),
             "MLX dense matmul: " + ", ".join(f"{k} {v:.2f} GFLOP/s" for k, v in result["dense_matmul_gflops"].items())]
    warned: dict[str, list[str]] = {}
    for name, entry in result["configs"].items():
        width = max([NAME_WIDTH] + [len(r["impl"]) for r in entry["rows"]])
        lines += ["", f"## {name}",
                  f"{'implementation':<{width}} {'ms/step':>9} {'prefill tok/s':>13} {'peak RSS GB':>11} {'MLX peak GB':>11}"]
        lines += [row_line(r, width) for r in entry["rows"]]
        for r in entry["rows"]:
            for w in r.get("warnings", ()):
                warned.setdefault(w, []).append(f"{name}: {r['impl']}")
        for ours in (r for r in entry["rows"] if "vs" in r):
            if ours["vs"]:
                lines.append(ratio_line(ours["impl"], ours["vs"]))
            lines.append(f"  {ours['flops_per_step'] / 1e9:.1f} GFLOP/step -> {ours['achieved_gflops']:.1f} GFLOP/s = "
                         f"{ours['fraction_of_dense_matmul']:.0%} of MLX dense {ours['dtype']} matmul; load "
                         f"{ours['load_seconds']:.1f} s, first step {ours['first_step_seconds']:.1f} s")
            if "seconds_per_step_eager" in ours:
                lines.append(f"  step: compiled {ours['seconds_per_step'] * 1e3:.1f} ms, eager "
                             f"{ours['seconds_per_step_eager'] * 1e3:.1f} ms "
                             f"(decoder pass alone {ours['seconds_decoder_only'] * 1e3:.1f} ms)")
        q = entry.get("quality")
        if q and "skipped" not in q:
            lines.append(f"quality, {q['fast']} vs exact: max rel logit error {q['step_max_rel_logit_error']:.2e} "
                         f"(step 1), {q['sc_step_max_rel_logit_error']:.2e} (self-conditioned); top-1 agreement "
                         f"{q['step_top1_agreement']:.1%} / {q['sc_step_top1_agreement']:.1%}; identical blocks "
                         f"{q['blocks_identical']}/{q['blocks_compared']}")
        elif q:
            lines.append(f"quality: skipped ({q['skipped']})")
        skipped = {study for study in ("moe", "sc_top_k")
                   if isinstance(entry.get(study), dict) and "skipped" in entry[study]}
        lines += [f"{study}: skipped ({entry[study]['skipped']})" for study in sorted(skipped)]
        for prec, parts in entry.get("breakdown", {}).items():
            if "skipped" in parts:
                lines.append(f"breakdown ({prec}): skipped ({parts['skipped']})")
                continue
            lines.append(f"breakdown ({prec}, ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
        if "moe" in entry and "moe" not in skipped:
            lines.append("MoE (one layer): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in entry["moe"].items()))
        if "sc_top_k" in entry and "sc_top_k" not in skipped:
            lines.append("self-conditioning: " + ", ".join(
                f"{'exact' if r['sc_top_k'] is None else 'top-' + str(r['sc_top_k'])} "
                f"{r['soft_embedding_seconds'] * 1e3:.1f} ms (err {r['max_rel_logit_error']:.1e})"
                for r in entry["sc_top_k"]))
        if "formats" in entry:
            f = entry["formats"]
            step = lambda r: (f"skipped ({r.get('skipped', 'no figure')})" if r["seconds_per_step"] is None  # noqa: E731
                              else f"{r['seconds_per_step']:.3f} s/step")
            lines.append(f"formats: exact {f['exact']['bytes'] / 1e6:.1f} MB {step(f['exact'])}; "
                         f"compact {f['compact']['bytes'] / 1e6:.1f} MB {step(f['compact'])}")
    if warned:
        lines += ["", "warnings raised during the measurements:"]
        lines += [f"  {w} ({'; '.join(rows)})" for w, rows in warned.items()]
    return "\n".join(lines)


def emit(result: dict, path: str | os.PathLike | None) -> None:
    """A benchmark's result: printed as one JSON line (after its table), and written, indented,
    to ``path`` (its folder made) when one is given."""
    import json
    from pathlib import Path

    print(json.dumps(result))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
