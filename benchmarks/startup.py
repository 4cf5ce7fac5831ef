"""Startup: wall time of the commands that should answer at once (help, version, argument and
missing-file errors), each in a fresh interpreter, median of N runs. Prints a table and JSON.

    python benchmarks/startup.py [--runs 5] [--python [LABEL=]PATH ...]

Several interpreters (e.g. one venv per branch: ``--python before=/venv-main/bin/python
--python after=/venv-branch/bin/python``) are measured interleaved, run by run, so that a
machine shared with other work loads them alike.

Nothing is loaded or generated: these are the costs of imports and argument checks only
(issue 20: "an instant start", target <= 0.5 s for --version and a missing-file error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS: dict[str, list[str]] = {
    "--version": ["--version"],
    "--help": ["--help"],
    "generate --help": ["generate", "--help"],
    "serve --help": ["serve", "--help"],
    "generate: missing --model file": ["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"],
    "generate: bad flag value": ["generate", "--demo", "--prompt", "hi", "--steps", "0"],
    "serve: missing --model file": ["serve", "--model", "/nonexistent/model.gguf"],
    "convert: missing GGUF": ["convert", "/nonexistent/model.gguf", "/tmp/mlx-dgemma-startup-out"],
    # issue 30's slow refusals (stderr is a pipe here: chat has no terminal)
    "chat --demo: no terminal": ["chat", "--demo"],
    "generate: --precision exact --dtype bfloat16": ["generate", "--demo", "--prompt", "hi", "--precision", "exact",
                                                     "--dtype", "bfloat16"],
}


def run_once(python: str, argv: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    # cwd outside any checkout: `-m` puts the working directory first on sys.path
    r = subprocess.run([python, "-m", "mlx_dgemma", *argv], capture_output=True, text=True, cwd=tempfile.gettempdir())
    return time.perf_counter() - t0, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per command (the median is reported)")
    ap.add_argument("--python", action="append", metavar="[LABEL=]PATH",
                    help="an interpreter with mlx_dgemma installed (repeatable; default: this one)")
    args = ap.parse_args()
    pythons = dict((p.split("=", 1) if "=" in p else (p, p)) for p in (args.python or [sys.executable]))
    times: dict[tuple[str, str], list[float]] = {(lab, c): [] for lab in pythons for c in COMMANDS}
    codes: dict[tuple[str, str], set[int]] = {k: set() for k in times}
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            for label, python in pythons.items():
                t, code = run_once(python, argv)
                times[label, name].append(t)
                codes[label, name].add(code)
    width = max(map(len, COMMANDS))
    labels = list(pythons)
    print(f"{'command':<{width}}  " + "  ".join(f"{lab[:14]:>14}" for lab in labels) + "   (median s; exit)")
    results: dict[str, dict] = {lab: {} for lab in labels}
    for name in COMMANDS:
        cells = []
        for lab in labels:
            ts = times[lab, name]
            results[lab][name] = {"median_s": round(statistics.median(ts), 3), "min_s": round(min(ts), 3),
                                  "max_s": round(max(ts), 3), "exit_codes": sorted(codes[lab, name])}
            cells.append(f"{statistics.median(ts):8.3f} ({','.join(map(str, sorted(codes[lab, name])))})")
        print(f"{name:<{width}}  " + "  ".join(f"{c:>14}" for c in cells))
    print(json.dumps({"machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}, "
                                 f"{os.cpu_count()} CPUs", "runs": args.runs,
                      "load_average": [round(x, 2) for x in os.getloadavg()], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
