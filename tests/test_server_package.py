"""The server package's place in the layout (issue 22 item 4): it uses the core, the core
never uses it, and no import cycle passes through it or the core's model worker (the
command line imports the server, never the reverse). Read from the sources with `ast`,
function-level imports included."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT / "mlx_dgemma").with_suffix("")
    parts = ["mlx_dgemma", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges() -> dict[str, set[str]]:
    """module -> mlx_dgemma modules it imports (core and server files)."""
    files = sorted((ROOT / "mlx_dgemma").glob("*.py")) + sorted((ROOT / "mlx_dgemma" / "server").glob("*.py"))
    known = {_module(f) for f in files}
    out: dict[str, set[str]] = {}
    for f in files:
        mod = _module(f)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in known:
                    n = n.rpartition(".")[0]
                if n and n != mod and n != "mlx_dgemma":
                    deps.add(n)
    return out


def test_no_import_cycle_through_the_server_or_the_worker():
    edges = _edges()
    watched = [m for m in edges if m.startswith("mlx_dgemma.server") or m == "mlx_dgemma.worker"]
    assert "mlx_dgemma.server.app" in watched and "mlx_dgemma.worker" in watched

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for d in edges.get(m, ()):
                if d == goal:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False

    cycles = [m for m in watched if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}"
    assert "mlx_dgemma.cli" not in set().union(*(edges[m] for m in watched))


def test_the_core_never_imports_the_server():
    edges = _edges()
    bad = [f"{m} -> {d}" for m, ds in edges.items() if not m.startswith("mlx_dgemma.server") and m != "mlx_dgemma.cli"
           for d in ds if d.startswith("mlx_dgemma.server")]
    assert not bad, bad


def test_help_does_not_import_the_web_stack():
    # `mlx-dgemma --help` builds serve's parser: server.cli only, not FastAPI or uvicorn
    code = ("import sys; from mlx_dgemma.cli import build_parser; build_parser(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'pydantic')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_app_starts_and_stops_its_engine_in_the_lifespan(tmp_path, monkeypatch):
    # in process, without the command line: the lifespan loads the model on the worker and,
    # at shutdown, stops the worker; routes reach the engine through app.state and Depends
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    engine = Engine(demo=True)
    app = create_app(engine)
    assert not engine.alive
    with TestClient(app) as client:
        assert app.state.engine is engine and engine.alive
        assert client.get("/health").json()["model"] == "mlx-dgemma-demo"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 4, "max_denoising_steps": 1, "seed": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        r = client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: not valid JSON (Expecting")
    assert not engine.alive and not engine.worker.busy


def test_validation_errors_keep_the_bodies_of_the_single_module_server():
    # FastAPI validates the typed bodies; the handler answers in our words (the registry's rule
    # for a sampler field, what was expected and what came for the others), never pydantic's,
    # and keeps the bodies the server answered before it did, without loading any model
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    client = TestClient(create_app(Engine(demo=True)))  # no lifespan: the model never loads
    cases = [
        (b"", "body: empty; send a JSON object", None),
        (b"[1, 2]", "body: expected a JSON object, got list", None),
        (b"null", "body: expected a JSON object, got NoneType", None),
        (b"{", "body: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
               "send a JSON object", None),
        (b'{"messages": [1]}', "messages[0]: expected a JSON object, got 1", "messages[0]"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": 3}',
         "stream_options: expected a JSON object, got 3", "stream_options"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}',
         "messages[0].role: expected 'system', 'developer', 'user', 'assistant' or 'tool', got \"wizard\"",
         "messages[0].role"),
        # a sampler field in the registry's words (mlx_dgemma.params), not pydantic's
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_denoising_steps": 100000}',
         "max_denoising_steps: must be an integer in [1, 10000]", "max_denoising_steps"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "t_min": "warm"}',
         "t_min: must be a temperature in [0.001, 1000]", "t_min"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": -2}',
         "seed: must be an integer in [0, 2**64 - 1], or -1 (random)", "seed"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
         "max_tokens: must be at least 1, got 0", "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
         "stream: expected true or false, got \"yes\"", "stream"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n: only n=1 is supported", "n"),
    ]
    for body, message, param in cases:
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                                               "param": param, "code": None}}, (body, r.json())


def test_a_generating_endpoint_is_declared_in_one_place(tmp_path, monkeypatch):
    # issue 34: a new generating endpoint is its body, its formatter and its row; the route (with
    # and without /v1), the body's validation errors, the engine's job and the stream all follow
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app
    from mlx_dgemma.server.endpoints import ENDPOINTS, Endpoint, Shaped
    from mlx_dgemma.server.openai import Formatter
    from mlx_dgemma.server.schemas import Sampling

    class ShoutRequest(Sampling):
        text: str

    class ShoutFormatter(Formatter):
        object, chunk_object, id_prefix = "shout", "shout.chunk", "shout-"

        def choice(self, r):
            return {"shout": r.content.upper(), "finish_reason": r.finish_reason}

        def delta_choice(self, content, reasoning, finish, role, tool_calls, logprobs):
            return {"shout": content.upper(), "finish_reason": finish}

    def shape(engine, body):
        ids, gen = engine.prepare_completion(body.text, engine.sampler_overrides(body, body.max_tokens))
        return Shaped("completion", ids, gen)

    shout = Endpoint("/v1/shout", ShoutRequest, shape, ShoutFormatter)  # the one declaration
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    body = {"max_tokens": 8, "max_denoising_steps": 1, "commit_entropy": 0, "seed": 1}
    with TestClient(create_app(Engine(demo=True), endpoints=(*ENDPOINTS, shout))) as client:
        done = client.post("/v1/completions", json={**body, "prompt": "Once upon a time"}).json()["choices"][0]
        text = done["text"]
        assert text.strip()
        r = client.post("/v1/shout", json={**body, "text": "Once upon a time"})
        assert r.status_code == 200, r.json()
        out = r.json()
        assert out["object"] == "shout" and out["id"].startswith("shout-") and out["usage"]["completion_tokens"] <= 8
        assert out["choices"] == [{"shout": text.upper(), "finish_reason": done["finish_reason"]}]
        assert client.post("/shout", json={**body, "text": "Once upon a time"}).json()["choices"] == out["choices"]
        with client.stream("POST", "/v1/shout", json={**body, "text": "Once upon a time", "stream": True}) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and {c["object"] for c in chunks} == {"shout.chunk"}
        assert "".join(c["choices"][0]["shout"] for c in chunks) == text.upper()
        r = client.post("/v1/shout", json={**body, "text": 3})  # the body's own field, in our words
        assert r.status_code == 400 and r.json()["error"]["message"] == "text: expected a string, got 3"
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body}) \
            .json()["object"] == "chat.completion"  # the rows before it keep theirs


def test_a_wrong_method_is_told_which_methods_the_route_takes():
    # RFC 9110: a 405 carries Allow; the message names the methods too
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    client = TestClient(create_app(Engine(demo=True)))  # no lifespan: the model never loads
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/health", "GET")):
        r = client.request(method, path)
        assert r.status_code == 405, (method, path, r.text)
        assert allowed in r.headers["allow"], r.headers
        assert r.json()["error"]["message"] == (f"{method} {path}: method not allowed; "
                                                f"this route takes {r.headers['allow']}")
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_metrics_count_the_requests_answered_with_a_client_error():
    # /metrics counted served, cancelled and 503-refused requests; a 4xx left every counter as it was
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    client = TestClient(create_app(Engine(demo=True)))  # no lifespan: the model never loads

    def rejected() -> int:
        line = next(ln for ln in client.get("/metrics").text.splitlines()
                    if ln.startswith("mlx_dgemma_requests_rejected_total "))
        return int(float(line.split()[1]))

    before = rejected()
    statuses = [client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}),
                client.get("/v1/nothing"), client.delete("/health"),
                client.post("/v1/chat/completions", content=b"x", headers={"content-type": "text/plain"})]
    assert [r.status_code for r in statuses] == [400, 404, 405, 415]
    assert rejected() == before + 4
    assert client.get("/health").status_code in (200, 503) and rejected() == before + 4  # not a client error
