"""Startup: wall time of the commands that should answer at once (help, version, argument and
missing-file errors), each in a fresh interpreter, median of N runs. Prints a table and JSON.

    python benchmarks/startup.py [--runs 5] [--python PATH]

Nothing is loaded or generated: these are the costs of imports and argument checks only
(issue 20: "an instant start", target <= 0.5 s for --version and a missing-file error).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
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
}


def time_command(python: str, argv: list[str], runs: int) -> dict:
    times, codes = [], set()
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run([python, "-m", "mlx_dgemma", *argv], capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        codes.add(r.returncode)
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "exit_codes": sorted(codes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per command (the median is reported)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter to run mlx_dgemma with")
    args = ap.parse_args()
    rows = {name: time_command(args.python, argv, args.runs) for name, argv in COMMANDS.items()}
    width = max(map(len, rows))
    print(f"{'command':<{width}}  median s    min s    max s  exit")
    for name, r in rows.items():
        print(f"{name:<{width}}  {r['median_s']:8.3f} {r['min_s']:8.3f} {r['max_s']:8.3f}  {r['exit_codes']}")
    print(json.dumps({"machine": f"{platform.machine()} {platform.system()}, {platform.python_version()}",
                      "runs": args.runs, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
