"""Tensor parallelism: per-step time, per-rank memory and communication with 1 and 2 ranks.

Each row is a fresh run: one process for 1 rank, ``mlx.launch -n 2 --backend ring`` for 2
(both ranks on this machine, over loopback). Every rank loads the model (its slices only),
prefills a random prompt and times the compiled denoising step. The collectives of one step
are recorded (an eager step with ``mx.distributed`` wrapped to count them), giving the bytes
each rank sends per step, and replayed alone on random arrays of the same shapes: the
replay's time over the step's time is the communication share. Prints a table and writes JSON.

    python benchmarks/distributed.py --configs medium
    python benchmarks/distributed.py --configs real-shapes --canvas 32 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAUNCH = [sys.executable, "-c", "import sys; from importlib.metadata import entry_points; "
          "sys.exit(entry_points(group='console_scripts')['mlx.launch'].load()())"]


def _record_collectives(run_step) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(op, shape, dtype, bytes in) of every collective one eager step issues."""
    import mlx.core as mx

    seen: list[tuple[str, tuple[int, ...], str, int]] = []
    originals = {n: getattr(mx.distributed, n) for n in ("all_sum", "all_max", "all_gather")}

    def wrap(name):
        def f(x, *a, **k):
            seen.append((name, tuple(x.shape), str(x.dtype).split(".")[-1], x.nbytes))
            return originals[name](x, *a, **k)
        return f

    try:
        for n in originals:
            setattr(mx.distributed, n, wrap(n))
        run_step()
    finally:
        for n, f in originals.items():
            setattr(mx.distributed, n, f)
    return seen


def sent_per_rank(op: str, nbytes: int, ranks: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` input on a ring of ``ranks``
    (reduce-scatter + all-gather for the reductions, ranks - 1 hops for a gather)."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) * nbytes if op == "all_gather" else 2 * (ranks - 1) / ranks * nbytes


def worker(model_dir: str, steps: int, prompt_len: int, precision: str, out: str) -> None:
    import mlx.core as mx
    import numpy as np

    from mlx_dgemma import distributed, load
    from mlx_dgemma.sampler import SamplerParams
    from mlx_dgemma.step import StepFunction

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    runtime = load(model_dir, precision=precision)
    model = runtime.model
    load_s = time.perf_counter() - t0
    weights = mx.get_active_memory()
    load_peak = mx.get_peak_memory()
    group = model.group
    ranks = distributed.size_of(group)
    a = model.args
    rng = np.random.default_rng(0)
    cache = model.make_cache()
    model.prefill(mx.array(rng.integers(0, a.vocab_size, (1, prompt_len)), dtype=mx.int32), cache)
    canvas = mx.array(rng.integers(0, a.vocab_size, (1, a.canvas_length)), dtype=mx.int32)
    params = SamplerParams.from_config(None)
    step = runtime.step(params)
    hist = step.initial_history((1, a.canvas_length))
    key = mx.random.key(0)

    def one(sc):
        o = step(canvas, sc, 0.6, key, hist, cache)
        mx.eval(o["canvas"], o["processed"], o["stop"], o["finite"])
        return o

    sc = one(None)["processed"]  # the first call traces; the timed steps use self-conditioning
    one(sc)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        one(sc)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    peak = mx.get_peak_memory()

    comm = []
    comm_s = 0.0
    if group is not None:
        eager = StepFunction(model, params, runtime.activation_dtype, compile=False,
                             precision_sc_top_k=runtime.precision.sc_top_k)
        comm = _record_collectives(lambda: mx.eval(eager(canvas, sc, 0.6, key, hist, cache)["canvas"]))
        fns = {"all_sum": mx.distributed.all_sum, "all_max": mx.distributed.all_max,
               "all_gather": mx.distributed.all_gather}
        bufs = [mx.random.normal(s).astype(getattr(mx, d)) if d.startswith(("float", "bfloat")) else
                mx.zeros(s, dtype=getattr(mx, d)) for _, s, d, _ in comm]
        mx.eval(bufs)
        reps = []
        for _ in range(max(3, steps)):
            t = time.perf_counter()
            for (op, *_), b in zip(comm, bufs):  # one at a time, as the step's dependencies order them
                mx.eval(fns[op](b, group=group))
            reps.append(time.perf_counter() - t)
        comm_s = statistics.median(reps)
    res = {"ranks": ranks, "rank": distributed.rank_of(group), "load_s": round(load_s, 2),
           "weights_mb": round(weights / 1e6, 1), "load_peak_mb": round(load_peak / 1e6, 1),
           "peak_mb": round(peak / 1e6, 1), "step_ms": round(step_s * 1e3, 1),
           "step_ms_all": [round(t * 1e3, 1) for t in times],
           "collectives_per_step": len(comm),
           "payload_bytes_per_step": sum(c[3] for c in comm),
           "sent_bytes_per_rank_per_step": round(sum(sent_per_rank(c[0], c[3], ranks) for c in comm)),
           "comm_ms_replayed": round(comm_s * 1e3, 1),
           "comm_share": round(comm_s / step_s, 3) if group is not None else 0.0,
           "collectives": [list(c) for c in comm]}
    Path(f"{out}.rank{res['rank']}.json").write_text(json.dumps(res))


def run(config: str, canvas: int | None, ranks: int, steps: int, prompt_len: int, precision: str,
        workdir: Path) -> list[dict]:
    from mlx_dgemma.bench.configs import build

    _, model_dir = build(config, workdir, canvas)
    out = workdir / f"dist-{config}-{ranks}"
    for f in workdir.glob(out.name + ".rank*.json"):
        f.unlink()
    cmd = [sys.executable, __file__, "--worker", str(model_dir), "--steps", str(steps), "--prompt-len",
           str(prompt_len), "--precision", precision, "--out", str(out)]
    if ranks > 1:
        cmd = LAUNCH + ["-n", str(ranks), "--backend", "ring", "--"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(f.read_text()) for f in sorted(workdir.glob(out.name + ".rank*.json"))]
    if len(rows) != ranks:
        raise SystemExit(f"{config} with {ranks} ranks failed:\n{r.stdout}\n{r.stderr}")
    return rows


def table(results: dict) -> str:
    lines = [f"machine: {results['machine']}", f"precision: {results['precision']}", "",
             f"{'config':<14}{'ranks':>6}{'ms/step':>10}{'x 1 rank':>9}{'weights MB/rank':>17}{'peak MB/rank':>14}"
             f"{'collectives':>12}{'MB sent/rank':>14}{'comm ms':>9}{'comm share':>11}"]
    for cfg, runs in results["configs"].items():
        base = runs["1"][0]["step_ms"]
        for n, rows in runs.items():
            r0 = rows[0]
            step = max(r["step_ms"] for r in rows)
            lines.append(f"{cfg:<14}{n:>6}{step:>10.1f}{base / step:>9.2f}"
                         f"{max(r['weights_mb'] for r in rows):>17.1f}{max(r['peak_mb'] for r in rows):>14.1f}"
                         f"{r0['collectives_per_step']:>12}{r0['sent_bytes_per_rank_per_step'] / 1e6:>14.2f}"
                         f"{r0['comm_ms_replayed']:>9.1f}{r0['comm_share']:>11.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["medium"])
    ap.add_argument("--canvas", type=int, default=None, help="canvas length (default: the config's)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (median reported)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--precision", default="fast")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("MLX_DGEMMA_BENCH_DIR", "/tmp/mlx-dgemma-bench")))
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.prompt_len, args.precision, args.out)
        return
    import platform

    import mlx.core as mx

    results = {"machine": f"{platform.platform()}, {os.cpu_count()} cores, {mx.default_device()}, "
                          f"mlx {mx.__version__}, ring backend over loopback",
               "precision": args.precision, "canvas": args.canvas, "configs": {}}
    for cfg in args.configs:
        name = cfg if args.canvas is None else f"{cfg}-c{args.canvas}"
        results["configs"][name] = {}
        for n in args.ranks:
            print(f"[{name}] {n} rank(s) ...", file=sys.stderr, flush=True)
            results["configs"][name][str(n)] = run(cfg, args.canvas, n, args.steps, args.prompt_len,
                                                   args.precision, args.workdir)
    print(table(results))
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        args.json.with_suffix(".txt").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
