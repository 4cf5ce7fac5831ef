"""Server overhead: a one-block answer through `mlx-dgemma serve` vs the same generation in process.

    python benchmarks/server_overhead.py [--reps 10] [--steps 4] [--json results/server_overhead.json]
    python benchmarks/server_overhead.py --load [--clients 1,4,8,16] [--soak 150] [--steps 4] [--json FILE]

The server runs as a subprocess (`mlx-dgemma serve --demo --port 0`); this process loads the
same demo model and runs the same requests directly (same prompt, seed and settings, so the
same tokens and the same number of steps), alternating A/B to cancel machine drift. Reported:

* wall time per answer: ChatSession.stream (what the server runs), stream_generate (no cache
  commit for reuse), the server non-streaming and streaming (client round trip, keep-alive);
* overhead = (server - direct) / server, on the medians, and per request from the server's own
  log: client wall time minus the engine's time for the job (HTTP, JSON, queue hand-offs);
* prefix reuse: turn 2 of a conversation continued (only the new turn prefilled) vs sent fresh.

``--load`` measures the server under parallel clients instead (:func:`load_main`, its own section
below): throughput (requests/min) and p50/p95 latency with 1, 4, 8 and 16 parallel clients (the
official ``openai`` client, one per thread), a soak of ``--soak`` requests with the server's RSS at
its start and end, and disconnects (streams closed after their first chunk, requests abandoned by
a client timeout): how long until the server is idle again, and that it answers afterwards.
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
from collections.abc import Callable

PROMPT = "Why is the sky blue?"


class Server:
    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_dgemma", "serve", "--demo", "--port", "0", *extra],
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
    ap.add_argument("--load", action="store_true", help="parallel clients, soak and disconnects instead")
    ap.add_argument("--clients", default="1,4,8,16", help="--load: parallel client counts")
    ap.add_argument("--soak", type=int, default=150, help="--load: requests of the soak")
    args = ap.parse_args()
    if args.load:
        return load_main(args)

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
    from mlx_dgemma.bench.report import emit  # after the measurement: the client never held MLX meanwhile

    emit(result, args.json)
    return 0


# --------------------------------------------------------------------------- load, soak, disconnects
# (python benchmarks/server_overhead.py --load)


def rss_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (Linux /proc, else ``ps``: macOS too; 0 where unknown)."""
    from mlx_dgemma.rss import process_rss_bytes

    return process_rss_bytes(pid)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_clients(base_url: str, clients: int, total: int, body: "Callable[[int], dict]") -> dict:
    """``total`` chat requests from ``clients`` threads (each its own openai client, closed loop):
    wall time, throughput, latency percentiles, failures."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    lock = threading.Lock()
    nxt = [0]
    lat: list[float] = []
    fails: list[str] = []

    def client() -> None:
        oa = openai.OpenAI(base_url=base_url, api_key="unused", timeout=3600, max_retries=0)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= total:
                return
            b = body(i)
            t0 = time.perf_counter()
            try:
                if b.get("stream"):
                    text = "".join(c.choices[0].delta.content or "" for c in
                                   oa.chat.completions.create(**b) if c.choices)
                else:
                    text = oa.chat.completions.create(**b).choices[0].message.content
                assert isinstance(text, str)
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    fails.append(f"{type(e).__name__}: {str(e)[:120]}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": total, "ok": len(lat), "failed": len(fails), "wall_s": round(wall, 2),
            "req_per_min": round(60 * len(lat) / wall, 2),
            "p50_s": round(percentile(lat, 50), 2), "p95_s": round(percentile(lat, 95), 2),
            "errors": sorted(set(fails))[:5]}


def health(conn_port: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", conn_port, timeout=30)
    c.request("GET", "/health")
    out = json.loads(c.getresponse().read())
    c.close()
    return out


def disconnects(server: Server, body: dict, client_body: dict, n: int = 4) -> dict:
    """``n`` streams closed after their first chunk and ``n`` non-streaming requests abandoned by a
    1 s client timeout, all at once: seconds until the server is idle, the cancelled count, and
    whether the next request is answered."""
    import socket

    port = server.port
    before = sum("finish=cancelled" in ln for ln in server.posts())
    data = json.dumps(body).encode()
    socks = []
    t0 = time.perf_counter()
    for i in range(2 * n):
        stream = i < n
        payload = json.dumps({**body, "stream": stream, "seed": 1000 + i}).encode() if stream else data
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        socks.append((s, stream))
    for s, stream in socks:
        try:
            if stream:
                s.recv(1)  # the response has begun (headers, the role chunk): then the client leaves
            else:
                s.settimeout(1.0)
                try:
                    s.recv(1)
                except socket.timeout:
                    pass
        finally:
            s.close()
    left = time.perf_counter()
    idle_after = None
    deadline = time.time() + 600
    while time.time() < deadline:
        h = health(port)
        if not h["busy"] and h["queued"] == 0:
            idle_after = round(time.perf_counter() - left, 2)
            break
        time.sleep(0.1)
    time.sleep(0.5)  # the log line follows the worker's release
    cancelled = sum("finish=cancelled" in ln for ln in server.posts()) - before
    t1 = time.perf_counter()
    ok = run_clients(f"http://127.0.0.1:{port}/v1", 1, 1, lambda i: client_body)["ok"] == 1
    return {"clients_gone": 2 * n, "idle_after_last_left_s": idle_after, "cancelled_by_server": int(cancelled),
            "next_request_ok": ok, "next_request_s": round(time.perf_counter() - t1, 2),
            "total_s": round(time.perf_counter() - t0, 2)}


def load_main(args: argparse.Namespace) -> int:
    """Throughput and latency with parallel clients, the soak, disconnects: a table, then JSON."""
    import platform

    levels = [int(c) for c in args.clients.split(",") if c]
    server = Server("--queue-size", str(max(levels + [16])))
    base = f"http://127.0.0.1:{server.port}/v1"
    C = 64  # the demo's canvas: one block per answer

    def body(i: int, stream: bool = False) -> dict:
        return {"model": "mlx-dgemma-demo", "seed": i, "max_tokens": C, "stream": stream,
                "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}],
                "extra_body": {"max_denoising_steps": args.steps}}

    load0 = os.getloadavg()
    run_clients(base, 1, 2, body)  # warm: kernels, the step's trace
    rows = [run_clients(base, c, max(8, 2 * c), lambda i, c=c: body(10_000 * c + i)) for c in levels]
    rss0 = rss_bytes(server.proc.pid)
    soak_rss = [rss0]
    soak: list[dict] = []
    per = 25
    for k in range(0, args.soak, per):
        n = min(per, args.soak - k)
        soak.append(run_clients(base, 4, n, lambda i, k=k: body(500_000 + k + i, stream=(k + i) % 2 == 1)))
        soak_rss.append(rss_bytes(server.proc.pid))
    gone = disconnects(server, {k: v for k, v in body(7).items() if k != "extra_body"} |
                       {"max_denoising_steps": args.steps}, body(8))
    load1 = os.getloadavg()
    errors = [ln for ln in server.lines if "Traceback" in ln or " 500 " in ln]
    server.stop()
    soak_ok = sum(r["ok"] for r in soak)
    soak_wall = sum(r["wall_s"] for r in soak)
    result = {
        "model": "demo", "canvas": C, "max_denoising_steps": args.steps,
        "backend": "MLX CPU", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
        "levels": rows,
        "soak": {"requests": args.soak, "ok": soak_ok, "failed": sum(r["failed"] for r in soak),
                 "clients": 4, "stream_share": 0.5, "wall_s": round(soak_wall, 1),
                 "req_per_min": round(60 * soak_ok / soak_wall, 2) if soak_wall else None,
                 "rss_mb": [round(b / 1e6, 1) for b in soak_rss]},
        "disconnects": gone,
        "server_tracebacks_or_500": len(errors),
    }
    print(f"server under load: demo model, one {C}-token block, <= {args.steps} steps; {result['machine']}, "
          f"MLX CPU; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print("| clients | requests | ok | req/min | p50 s | p95 s |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['ok']} | {r['req_per_min']} | {r['p50_s']} | {r['p95_s']} |")
    sk = result["soak"]
    print(f"soak: {sk['ok']}/{sk['requests']} ok, {sk['req_per_min']} req/min, RSS {sk['rss_mb'][0]} -> "
          f"{sk['rss_mb'][-1]} MB (every 25: {sk['rss_mb']})")
    print(f"disconnects: {gone['clients_gone']} clients left; idle {gone['idle_after_last_left_s']} s after the "
          f"last left, {gone['cancelled_by_server']} cancelled; next request ok: {gone['next_request_ok']}")
    from mlx_dgemma.bench.report import emit  # after the measurement: the client never held MLX meanwhile

    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
