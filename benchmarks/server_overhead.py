"""Server overhead: a one-block answer through `mlx-dgemma serve` vs the same generation in process.

    python benchmarks/server_overhead.py [--reps 10] [--steps 4] [--json results/server_overhead.json]

The server runs as a subprocess (`mlx-dgemma serve --demo --port 0`); this process loads the
same demo model and runs the same requests directly (same prompt, seed and settings, so the
same tokens and the same number of steps), alternating A/B to cancel machine drift. Reported:

* wall time per answer: ChatSession.stream (what the server runs), stream_generate (no cache
  commit for reuse), the server non-streaming and streaming (client round trip, keep-alive);
* overhead = (server - direct) / server, on the medians, and per request from the server's own
  log: client wall time minus the engine's time for the job (HTTP, JSON, queue hand-offs);
* prefix reuse: turn 2 of a conversation continued (only the new turn prefilled) vs sent fresh.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT = "Why is the sky blue?"


class Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"on http://[\d.]+:(\d+)/v1", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(600)
        if self.port is None:
            raise SystemExit("server did not start:\n" + "".join(self.lines[-20:]))
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

    def post(self, body: dict) -> tuple[float, dict | str]:
        """(client wall seconds, answer); returns once the request's log line is written, so that
        the worker's cache commit after the answer never overlaps the next measurement."""
        n = len(self.posts())
        data = json.dumps(body)
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
            r = self.conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closed an idle keep-alive connection: reconnect (timed, as a client would)
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            self.conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
            r = self.conn.getresponse()
        raw = r.read().decode()
        dt = time.perf_counter() - t0
        self.log = self.log_of(n)
        if body.get("stream"):
            text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                           for ln in raw.splitlines() if ln.startswith("data: {") and '"choices":[{' in ln)
            return dt, text
        return dt, json.loads(raw)

    def posts(self) -> list[str]:
        return [ln for ln in self.lines if "POST /v1/chat/completions" in ln]

    def log_of(self, index: int) -> dict[str, str]:
        """The fields of the index-th request's log line (written once the worker is done)."""
        deadline = time.time() + 30
        while time.time() < deadline:
            lines = self.posts()
            if len(lines) > index:
                return dict(kv.split("=", 1) for kv in lines[index].split() if "=" in kv)
            time.sleep(0.01)
        return {}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4, help="max denoising steps of the block")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()

    from mlx_dgemma import ChatSession, stream_generate
    from mlx_dgemma import load_demo
    from mlx_dgemma.events import DoneEvent

    server = Server()
    rt = load_demo()
    cfg = rt.generation_config
    C = rt.model.args.canvas_length
    params = dict(max_new_tokens=C, max_denoising_steps=args.steps)

    def direct_session(seed: int) -> tuple[float, str, int]:
        t0 = time.perf_counter()
        s = ChatSession(rt, cfg)
        for ev in s.stream(PROMPT, seed=seed, **params):
            pass
        assert isinstance(ev, DoneEvent)
        return time.perf_counter() - t0, ev.text, ev.steps

    def direct_generate(seed: int) -> float:
        t0 = time.perf_counter()
        for ev in stream_generate(rt, PROMPT, generation_config=cfg, seed=seed, **params):
            pass
        return time.perf_counter() - t0

    def body(seed: int, stream: bool = False) -> dict:
        return {"messages": [{"role": "user", "content": PROMPT}], "seed": seed, "max_tokens": C,
                "max_denoising_steps": args.steps, "stream": stream}

    for seed in (100, 101):  # warm both sides (kernels, traces, connection)
        direct_session(seed), direct_generate(seed), server.post(body(seed)), server.post(body(seed, True))

    rows: dict[str, list[float]] = {k: [] for k in ("session", "generate", "server", "server_stream")}
    per_request: list[float] = []  # client wall - the worker's time to the answer, same request
    same = 0
    steps = []
    for i in range(args.reps):
        dt, text, n = direct_session(i)
        rows["session"].append(dt)
        steps.append(n)
        rows["generate"].append(direct_generate(i))
        dt, r = server.post(body(i))
        rows["server"].append(dt)
        log = server.log
        if log.get("answer_s"):
            per_request.append(dt - float(log["answer_s"]))
        same += r["choices"][0]["message"]["content"] == text
        dt, streamed = server.post(body(i, True))
        rows["server_stream"].append(dt)
        same += streamed == text

    med = {k: statistics.median(v) for k, v in rows.items()}
    best = {k: min(v) for k, v in rows.items()}
    result = {
        "model": "demo", "canvas": C, "max_denoising_steps": args.steps, "reps": args.reps,
        "median_steps": statistics.median(steps),
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "min_seconds": {k: round(v, 4) for k, v in best.items()},
        "overhead_min_vs_session_pct": round(100 * (best["server"] - best["session"]) / best["server"], 2),
        "overhead_min_stream_vs_session_pct": round(100 * (best["server_stream"] - best["session"]) / best["server_stream"], 2),
        "overhead_vs_session_pct": round(100 * (med["server"] - med["session"]) / med["server"], 2),
        "overhead_stream_vs_session_pct": round(100 * (med["server_stream"] - med["session"]) / med["server_stream"], 2),
        "overhead_vs_generate_pct": round(100 * (med["server"] - med["generate"]) / med["server"], 2),
        "http_overhead_ms_median": round(1000 * statistics.median(per_request), 2) if per_request else None,
        "http_overhead_pct_median": round(100 * statistics.median(per_request) / med["server"], 2) if per_request else None,
        "answers_identical": f"{same}/{2 * args.reps}",
    }

    # prefix reuse: turn 2 continued vs the same turn 2 sent fresh
    msgs = [{"role": "system", "content": "You are a patient teacher who explains physics with everyday examples."},
            {"role": "user", "content": PROMPT}]
    _, t1 = server.post({"messages": msgs, "seed": 7, "max_tokens": C, "max_denoising_steps": args.steps})
    msgs2 = msgs + [{"role": "assistant", "content": t1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Explain it to a five-year-old, in one sentence."}]
    _, t2 = server.post({"messages": msgs2, "seed": 7, "max_tokens": C, "max_denoising_steps": args.steps})
    reuse_log = server.log
    server.post({**body(1), "messages": [{"role": "user", "content": "Something else entirely."}]})  # replaces the session
    _, t2f = server.post({"messages": msgs2, "seed": 7, "max_tokens": C, "max_denoising_steps": args.steps})
    fresh_log = server.log
    result["prefix_reuse"] = {
        "turn1_answer_tokens": t1["usage"]["completion_tokens"],
        "turn2_prompt_tokens": t2["usage"]["prompt_tokens"],
        "fresh_turn2_prompt_tokens": t2f["usage"]["prompt_tokens"],
        "reused_cached_tokens": t2["usage"]["prompt_tokens_details"]["cached_tokens"],
        "reused_prefilled_tokens": int(reuse_log.get("prefill", -1)),
        "reused_prefill_s": float(reuse_log.get("prefill_s", "nan")),
        "fresh_prefilled_tokens": int(fresh_log.get("prefill", -1)),
        "fresh_prefill_s": float(fresh_log.get("prefill_s", "nan")),
    }
    server.stop()

    print(f"server overhead, demo model, one {C}-token block, <= {args.steps} steps "
          f"(median {result['median_steps']}), {args.reps} reps")
    print("| path | median s | min s | overhead vs ChatSession (median / min) |\n| --- | --- | --- | --- |")
    for k, label in (("session", "ChatSession.stream (in process)"), ("generate", "stream_generate (in process)"),
                     ("server", "server, non-streaming"), ("server_stream", "server, streaming")):
        ov = 100 * (med[k] - med["session"]) / med[k]
        ob = 100 * (best[k] - best["session"]) / best[k]
        print(f"| {label} | {med[k]:.4f} | {best[k]:.4f} | {ov:+.2f}% / {ob:+.2f}% |")
    print(f"per request, client wall - worker time to the answer: median {result['http_overhead_ms_median']} ms "
          f"({result['http_overhead_pct_median']}% of wall); answers identical {result['answers_identical']}")
    pr = result["prefix_reuse"]
    print(f"prefix reuse: turn 2 = {pr['turn2_prompt_tokens']} prompt tokens; continued: {pr['reused_prefilled_tokens']} "
          f"prefilled ({pr['reused_cached_tokens']} cached) in {pr['reused_prefill_s']} s; fresh: "
          f"{pr['fresh_prefilled_tokens']} prefilled in {pr['fresh_prefill_s']} s")
    print(json.dumps(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
