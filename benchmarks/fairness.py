"""Fair sharing: short requests while a long one runs, one at a time vs taking turns.

    python benchmarks/fairness.py [--parallel 1,4] [--short 8] [--long-blocks 12] [--steps 8]
                                  [--code DIR] [--json results/fairness.json]

A server on the trained demo (``mlx-dgemma serve --demo``, a subprocess) gets one long request
(``--long prompt``, the default: a chat of about 3,800 tokens, whose prefill is 8 chunks of 512,
each a turn, then one block; ``call``: a forced tool call; ``text``: a raw continuation of up to
``--long-blocks`` blocks; the demo ends the last two within a block or two, so they hold the
model only briefly), at most ``--steps`` denoising steps a block; then, once it has started,
``--short`` short chat requests (one block, each its own seed), one every ``--interval`` seconds
(0: all at once), each from its own thread with the official ``openai`` client. Reported per setting: each short request's latency (p50, p95, max), the long one's
latency, and the whole run's wall time. ``--parallel 1`` is one request at a time to its end (the
server before issue 31); 4 lets four requests take turns at block boundaries (the default now).
``--code DIR`` runs the server from another checkout (e.g. main, for a before/after of the code
itself rather than of the flag).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


# about 3,800 tokens of the demo's vocabulary: 8 prefill chunks of 512, each a turn
LONG_PROMPT = "And the LORD spake unto Moses, saying, Speak unto the children of Israel. " * 250


def serve(parallel: int, code: str | None) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, **({"PYTHONPATH": code} if code else {})}
    flags = ["--parallel", str(parallel)] if parallel != 1 or not code else []
    proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if m and not url:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(600)
    if not url:
        raise SystemExit("server did not start:\n" + "".join(lines[-20:]))
    return proc, url[0], lines


def wait_ready(url: str) -> None:
    import urllib.error
    import urllib.request

    while True:  # the warm-up: /health is 503 "loading" until it ran (the code before answered 200 at once)
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            pass
        time.sleep(0.2)


def busy(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return bool(json.loads(r.read())["busy"])


def run(parallel: int, args: argparse.Namespace) -> dict:
    import openai

    proc, url, lines = serve(parallel, args.code)
    try:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        steps = {"max_denoising_steps": args.steps}
        # the answer guards off for the long one: on the demo they end a continuation early (main
        # has them too), and it must hold the model for all its blocks
        guards_off = {"commit_entropy": 0, "repetition_trim": 0, "duplicate_drop": 0, "empty_rerolls": 0}
        results: dict[str, float] = {}

        blocks_run: dict[str, int] = {}

        errors: dict[str, str] = {}

        def ask(name: str, content: str, blocks: int, seed: int) -> None:
            try:
                answer(name, content, blocks, seed)
            except Exception as e:  # noqa: BLE001 - reported in the row, not lost in a thread
                errors[name] = f"{type(e).__name__}: {e}"[:200]

        def answer(name: str, content: str, blocks: int, seed: int) -> None:
            t0 = time.perf_counter()
            if name == "long" and args.long == "prompt":  # a long document: its prefill's chunks are turns
                r = client.chat.completions.create(
                    model="demo", messages=[{"role": "user", "content": LONG_PROMPT + content}], max_tokens=64,
                    extra_body={**steps, "seed": seed})
            elif name == "long" and args.long == "call":  # a forced call: the demo never closes one
                r = client.chat.completions.create(
                    model="demo", messages=[{"role": "user", "content": content}], tools=[WEATHER],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64 * blocks,
                    extra_body={**steps, **guards_off, "seed": seed})
            elif name == "long":  # a raw continuation
                r = client.completions.create(model="demo", prompt=content, max_tokens=64 * blocks,
                                              extra_body={**steps, **guards_off, "seed": seed})
            else:
                r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                                   max_tokens=64 * blocks, extra_body={**steps, "seed": seed})
            results[name] = time.perf_counter() - t0
            blocks_run[name] = (r.model_extra or {}).get("timings", {}).get("diffusion", {}).get("blocks", -1)

        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        long = threading.Thread(target=ask, args=("long", "And it came to pass in those days, that", args.long_blocks,
                                                  args.long_seed))
        long.start()
        # the long one holds the model: the worker has taken it (its prompt is rendered and
        # tokenized first, on a handler thread, which takes seconds for the long prompt)
        while not busy(url):
            time.sleep(0.1)
        time.sleep(args.head_start)
        shorts = [threading.Thread(target=ask, args=(f"short{i}", f"Who was king number {i}?", 1, i + 1))
                  for i in range(args.short)]
        for t in shorts:  # arriving one every --interval seconds, as users and editors do
            t.start()
            time.sleep(args.interval)
        for t in [long, *shorts]:
            t.join()
        wall = time.perf_counter() - t0
        s = sorted(v for k, v in results.items() if k.startswith("short")) or [math.nan]
        return {"parallel": parallel, "code": args.code or "this checkout", "short_s": [round(x, 2) for x in s],
                "short_p50_s": round(statistics.median(s), 2),
                "short_p95_s": round(s[min(len(s) - 1, round(0.95 * (len(s) - 1)))], 2), "short_max_s": round(s[-1], 2),
                "long_s": round(results.get("long", math.nan), 2), "long_blocks": blocks_run.get("long"),
                "errors": errors, "wall_s": round(wall, 2),
                "load_before_after": [round(load0, 1), round(os.getloadavg()[0], 1)]}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", default="1,4", help="settings of --parallel to compare (default 1,4)")
    p.add_argument("--short", type=int, default=8, help="short requests sent while the long one runs (default 8)")
    p.add_argument("--long-blocks", type=int, default=12, help="blocks of the long request (default 12)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of a block at most (default 4)")
    p.add_argument("--long-seed", type=int, default=5, help="the long request's seed (5: 12 blocks, no EOS, on the demo)")
    p.add_argument("--long", choices=("prompt", "call", "text"), default="prompt",
                   help="the long request: a ~3,800-token prompt (8 prefill chunks, then one block), a forced "
                        "tool call, or a raw continuation (default prompt: the demo ends the other two within "
                        "a block or two)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between the short requests' arrivals")
    p.add_argument("--head-start", type=float, default=1.0,
                   help="seconds the long request runs alone once the worker has taken it (default 1)")
    p.add_argument("--code", default=None, help="run the server from this checkout (PYTHONPATH), e.g. /work/main")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.parallel.split(",")):
        row = run(n, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
