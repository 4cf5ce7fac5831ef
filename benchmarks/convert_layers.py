"""Issue 30 item 3 at the published shapes: ``convert`` exact against ``convert --precision q4``,
per tensor, on a GGUF holding the published inventory's first layers at full size.

    python benchmarks/convert_layers.py --workdir W [--layers 1] [--reps 3]
        [--impl NAME=PYTHON ...] [--json out.json]

The whole model does not fit most disks twice (16.8 GB GGUF + 21.4 GB exact directory), so
this writes ``benchmarks/full_size.py``'s first-N-layers file (``blk.0`` .. ``blk.N-1`` and
every tensor outside them at full size: the Q6_K embedding, self-conditioning, norms) and
times each tensor of each convert between the converter's per-tensor progress calls. A
layer's cost is the sum over its ``blk.i.`` tensors; the rest (opening the file, the
embedding, the vocabulary, the output files) is the fixed part; the 30-layer figure is
``fixed + 30 x layer`` (an extrapolation from measured tensors at their real shapes).

Every convert runs in a fresh child process, the precisions (and, with several ``--impl``,
the implementations: e.g. ``--impl main=/path/to/main/venv/bin/python --impl branch=python``)
taking turns rep by rep, so a change in the machine's load hits every row alike. Prints a table
and writes JSON (every rep's per-tensor times, the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

_LAYER = re.compile(r"^blk\.(\d+)\.")


def child(gguf: str, out: str, precision: str) -> dict:
    """One convert in this process: the seconds each tensor took (progress call to progress call)."""
    from mlx_dgemma.convert.converter import convert

    times: list[tuple[str, float]] = []
    last = [time.perf_counter()]
    t0 = last[0]

    def progress(done: int, total: int, i: int, n: int, name: str) -> None:
        now = time.perf_counter()
        times.append((name, now - last[0]))
        last[0] = now

    kw = {} if precision == "exact" else {"precision": precision}
    convert(gguf, out, progress=progress, **kw)
    whole = time.perf_counter() - t0
    return {"precision": precision, "seconds": whole, "tensors": times}


def summarize(run: dict) -> dict:
    """Whole, per layer (each ``blk.i.``'s tensors summed) and fixed (everything else)."""
    layers: dict[int, float] = {}
    for name, dt in run["tensors"]:
        m = _LAYER.match(name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0.0) + dt
    per_layer = statistics.mean(layers.values()) if layers else 0.0
    return {"whole": run["seconds"], "layer": per_layer, "fixed": run["seconds"] - sum(layers.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="the GGUF (~1.2 GB a layer) and the outputs")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--gguf", type=Path, default=None,
                    help="time this GGUF instead (e.g. a benchmark config's: mlx_dgemma.bench.configs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--precisions", default="exact,q4")
    ap.add_argument("--impl", action="append", default=[], metavar="NAME=PYTHON",
                    help="an implementation to time: a name and the Python (venv) that has it installed "
                         "(default: this Python)")
    ap.add_argument("--full-layers", type=int, default=30, help="layers of the whole model (extrapolation)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=3, metavar=("GGUF", "OUT", "PRECISION"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from full_size import first_layers, load_header, write_inventory_gguf  # noqa: E402 (a sibling script)
    from mlx_dgemma.bench.report import machine

    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.gguf or a.workdir / f"first-{a.layers}-layers.gguf"
    if not gguf.exists():
        print(f"writing {gguf} ...", file=sys.stderr, flush=True)
        part = gguf.with_suffix(".part")
        write_inventory_gguf(part, first_layers(load_header(), a.layers), seed=0)
        part.rename(gguf)
    impls = [tuple(s.split("=", 1)) for s in a.impl] or [("this", sys.executable)]
    precisions = a.precisions.split(",")
    runs: dict[str, list[dict]] = {f"{name} {p}": [] for name, _ in impls for p in precisions}
    loads: list[float] = []
    for rep in range(a.reps):
        for name, python in impls:
            for p in precisions:
                out = a.workdir / f"out-{p}"
                shutil.rmtree(out, ignore_errors=True)
                loads.append(os.getloadavg()[0])
                r = subprocess.run([python, __file__, "--workdir", str(a.workdir), "--child", str(gguf), str(out), p],
                                   capture_output=True, text=True, check=True)
                shutil.rmtree(out, ignore_errors=True)
                res = json.loads(r.stdout.strip().splitlines()[-1])
                runs[f"{name} {p}"].append(res)
                s = summarize(res)
                print(f"rep {rep}: {name:8s} {p:6s} whole {s['whole']:7.2f} s  layer {s['layer']:6.2f} s  "
                      f"fixed {s['fixed']:6.2f} s  (load {loads[-1]:.1f})", file=sys.stderr, flush=True)

    med: dict[str, dict] = {}
    for key, rs in runs.items():
        ss = [summarize(r) for r in rs]
        med[key] = {k: statistics.median(s[k] for s in ss) for k in ("whole", "layer", "fixed")}
        med[key]["full"] = med[key]["fixed"] + a.full_layers * med[key]["layer"]
    what = gguf.name if a.gguf else f"{a.layers} layer(s) at the published shapes"
    print(f"\n{what}, medians of {a.reps} (load average "
          f"{min(loads):.1f}-{max(loads):.1f})\n")
    extrapolate = a.full_layers > 0
    head = "| convert (seconds) | whole | vs exact | fixed | one layer | layer vs exact |"
    if extrapolate:
        head += f" {a.full_layers} layers (fixed + {a.full_layers} x layer) | vs exact |"
    print(head)
    print("| --- |" + " ---: |" * (head.count("|") - 2))
    for name, _ in impls:
        base = med.get(f"{name} exact")

        def vs(p: str, key: str) -> str:
            return f"{med[f'{name} {p}'][key] / base[key]:.2f}x" if base and p != "exact" else ""

        for p in precisions:
            m = med[f"{name} {p}"]
            row = (f"| {name} {p} | {m['whole']:.2f} | {vs(p, 'whole')} | {m['fixed']:.2f} | {m['layer']:.2f} | "
                   f"{vs(p, 'layer')} |")
            if extrapolate:
                row += f" {m['full']:.0f} | {vs(p, 'full')} |"
            print(row)
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "layers": a.layers, "reps": a.reps,
                                      "load_average": [min(loads), max(loads)], "medians": med,
                                      "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
