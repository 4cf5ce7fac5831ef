"""Hostile requests to the server found by attacking it (each a 500, a traceback or a wrong
field before its fix): every one is a 4xx naming the field, and the server answers the next
request as before."""

from __future__ import annotations

import json

import pytest


def _nested(depth: int) -> dict:
    v: dict = {"type": "string"}
    for _ in range(depth):
        v = {"type": "object", "properties": {"a": v}}
    return v


def _call_messages(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}]


ARGS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("body, param", [
    # json's decoder recursed out of its stack: a 500 and a traceback in the log
    ({"messages": _call_messages("[" * 100_000 + "]" * 100_000)}, ARGS),
    ({"messages": _call_messages(json.dumps({"a": _nested(300)}))}, ARGS),
    # the chat template recursed out of its stack: a 400 blaming "messages" and the template
    ({"messages": [{"role": "user", "content": "?"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(100)}}]},
     "tools[0].function.parameters"),
])
def test_deeply_nested_tool_json_is_400_naming_the_field(served, caplog, body, param):
    _, client = served
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 4, "max_denoising_steps": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":") and "levels deep" in err["message"]
    assert "Traceback" not in caplog.text


def test_tool_call_arguments_with_a_number_python_cannot_parse_are_400(served, caplog):
    # json.loads raises a plain ValueError (not a JSONDecodeError) past 4300 digits: was a 500
    _, client = served
    body = {"messages": _call_messages('{"a": 1' + "0" * 5000 + "}"), "max_tokens": 4, "max_denoising_steps": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ARGS and err["message"].startswith(ARGS + ": not valid JSON")
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("where", ["parameters", "arguments"])
def test_tool_json_with_nan_or_infinity_is_400_naming_the_field(served, caplog, number, where):
    # Python's json reads these (1e999 as inf): they were accepted and rendered into the prompt
    _, client = served
    if where == "parameters":
        body = {"messages": [{"role": "user", "content": "?"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
        param, raw = "tools[0].function.parameters", json.dumps(body).replace('"object"', f'"object", "x": {number}')
    else:
        body = {"messages": _call_messages(json.dumps({"a": [1, "NUMBER"]}))}
        param, raw = ARGS, json.dumps(body).replace('\\"NUMBER\\"', number)
    assert number in raw
    r = client.post("/v1/chat/completions", content=raw[:-1] + ', "max_tokens": 4, "max_denoising_steps": 1}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: not valid JSON: NaN/Infinity are not JSON values"), err
    assert "Traceback" not in caplog.text


def test_tool_json_of_ordinary_depth_is_served(served):
    _, client = served
    body = {"messages": _call_messages(json.dumps({"a": _nested(10)})), "max_tokens": 4, "max_denoising_steps": 1,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(20)}}], "seed": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def _flags(**kw):
    import argparse

    base = dict(queue_size=1, parallel=1, max_body_mb=1.0, max_request_steps=1, max_request_seconds=None, max_connections=1,
                header_timeout=1.0, body_timeout=1.0, api_key=None, cors=None, allowed_hosts=None,
                host="127.0.0.1", port=8080)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("flags, named", [
    # curl sends "Bearer é" as UTF-8, the server reads headers as Latin-1: this key never matched (401)
    ({"api_key": "é"}, "--api-key"),
    ({"api_key": " key"}, "--api-key"),  # HTTP trims the header's ends: never matched
    # a browser's Origin has no path: the origin given itself was refused ("Disallowed CORS origin")
    ({"cors": ["http://app.example/"]}, "--cors http://app.example/"),
    ({"cors": ["https://app.example/chat?x"]}, "--cors https://app.example/chat?x"),
    # a Host header's name never carries a scheme, a path or (as compared) a port
    ({"allowed_hosts": ["http://my.box"]}, "--allowed-hosts http://my.box"),
    ({"allowed_hosts": ["my.box:8080"]}, "--allowed-hosts my.box:8080"),
    ({"body_timeout": 0.0}, "--body-timeout"),
])
def test_flags_that_could_never_match_a_request_are_refused(flags, named):
    from mlx_dgemma.errors import ParameterError
    from mlx_dgemma.server.cli import check_args

    with pytest.raises(ParameterError) as e:  # before any model loads: a one-line error, exit 2
        check_args(_flags(**flags))
    assert str(e.value).startswith(named) and "\n" not in str(e.value)


def test_a_bare_origin_and_an_ascii_key_pass_the_checks():
    from mlx_dgemma.server.cli import check_args

    check_args(_flags(api_key="s3cret key", cors=["http://app.example", "https://[::1]:8443", "*"],
                      allowed_hosts=["my.box", "10.0.0.2", "[::1]", "*"]))


def test_a_request_dropped_before_it_ran_counts_as_cancelled():
    # a client that disconnects while its request waits: the worker skips it; /metrics'
    # requests_cancelled_total ("requests stopped before their answer") did not count it
    import asyncio

    from mlx_dgemma.server.engine import Engine, Job

    loop = asyncio.new_event_loop()
    try:
        engine = Engine(demo=True)  # not started: skipping needs no model
        engine._skip(Job("chat", [], {}, None, (), False, False, loop))
        counts = {name: value for name, _, value, _ in engine.metrics()}
        assert counts["requests_cancelled_total"] == 1 and counts["requests_served_total"] == 0
    finally:
        loop.close()


def _tools(n: int, words: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": "a b c d e f " * words}}
            for i in range(n)]


@pytest.mark.parametrize("tools", [
    _tools(300, 50),  # 141 kB: too many bytes for the demo's 4096-token context whatever the tokenizer does
    _tools(16, 50),  # 9 kB, but 5151 tokens once rendered
], ids=["bytes", "tokens"])
def test_tools_beyond_the_context_are_context_errors_naming_the_tools(served, tools):
    # were blamed on the messages ("shorten the messages") though the messages are one word
    _, client = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                  "max_tokens": 4, "max_denoising_steps": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and err["code"] == "context_length_exceeded", err
    assert err["message"].startswith("tools: ") and "send fewer or shorter tools" in err["message"], err


def test_messages_beyond_the_context_beside_tools_are_still_named_messages(served):
    _, client = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b c d e f " * 700}],
                                                  "tools": _tools(1, 1), "max_tokens": 4, "max_denoising_steps": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["message"].endswith("; shorten the messages"), err


def test_a_refused_cors_preflight_is_a_json_error_object(served):
    # was Starlette's plain-text "Disallowed CORS origin"
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import create_app
    from mlx_dgemma.server.app import Settings

    engine, _ = served
    client = TestClient(create_app(engine, Settings(cors_origins=("http://a.example",))))  # no lifespan: no restart
    pre = {"Access-Control-Request-Method": "POST"}
    r = client.options("/v1/chat/completions", headers={"Origin": "http://b.example", **pre})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "cors_disallowed", err
    assert err["message"].startswith("CORS preflight: disallowed origin;"), err
    assert "access-control-allow-origin" not in r.headers
    r = client.options("/v1/chat/completions", headers={"Origin": "http://a.example", **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
