"""The server's logprobs/top_logprobs, echo and timings, through the real HTTP path (in-process
FastAPI app on the demo model). That the log-probabilities are the committing step's, recomputed
from the model's logits, is tests/test_generate.py's; here: the OpenAI shapes, the tokens they
cover (as many as completion_tokens: stop strings and max_tokens cut both alike), streaming and
non-streaming agreeing, and the timings object."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from mlx_dgemma.tokenizer import Tokenizer

# two steps never converge on the fine-tuned demo (mean entropy 0.10-0.19): the commit guard off,
# as in the other tests of the server's mechanics, or every answer is re-rolled and then empty
FAST = {"max_denoising_steps": 2, "seed": 3, "commit_entropy": 0}
C, X = "/v1/chat/completions", "/v1/completions"


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "And God said"}], "max_tokens": 40, **FAST, **kw}


def stream(client: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def streamed_entries(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for c in chunks if c.get("choices") for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]


def check_entry(e: dict[str, Any], k: int) -> None:
    assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == k
    assert e["logprob"] <= 0 and math.isfinite(e["logprob"])
    tops = [t["logprob"] for t in e["top_logprobs"]]
    assert tops == sorted(tops, reverse=True)
    if k:
        assert tops[0] >= e["logprob"] - 1e-6


def test_chat_logprobs_cover_the_counted_tokens(served):
    engine, client = served
    r = client.post(C, json=chat(logprobs=True, top_logprobs=3)).json()
    choice = r["choices"][0]
    entries = choice["logprobs"]["content"]
    n = r["usage"]["completion_tokens"]
    assert len(entries) == n and (n == 40 or choice["finish_reason"] == "stop")  # max_tokens cuts both alike
    for e in entries:
        check_entry(e, 3)
    # the bytes are the tokens' own: together they are the answer as decoded
    raw = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")
    assert raw.startswith(choice["message"]["content"].rstrip("\ufffd")[:20])
    assert any(e["logprob"] < 0 for e in entries)  # not a column of zeros
    # the same request without logprobs: the same answer, and null logprobs as OpenAI sends
    plain = client.post(C, json=chat()).json()
    assert plain["choices"][0]["message"] == choice["message"] and plain["choices"][0]["logprobs"] is None
    # logprobs without top_logprobs: no top tokens
    r0 = client.post(C, json=chat(logprobs=True)).json()
    assert [e["logprob"] for e in r0["choices"][0]["logprobs"]["content"]] == [e["logprob"] for e in entries]
    assert all(e["top_logprobs"] == [] for e in r0["choices"][0]["logprobs"]["content"])


def first_unique(text: str) -> str:
    """A piece of ``text`` from its middle that occurs there first (a stop string that cuts it):
    the shortest such piece, from 3 characters (the demo repeats itself: "the the the")."""
    for width in range(3, 9):
        for p in range(len(text) // 4, 3 * len(text) // 4):
            piece = text[p:p + width]
            if piece.strip() and text.find(piece) == p:
                return piece
    raise AssertionError(f"no stop string in {text!r}")


def test_a_stop_string_cuts_logprobs_as_it_cuts_completion_tokens(served):
    _, client = served
    full = client.post(C, json=chat(logprobs=True, top_logprobs=1, max_tokens=60)).json()
    stop = first_unique(full["choices"][0]["message"]["content"])
    cut = client.post(C, json=chat(logprobs=True, top_logprobs=1, max_tokens=60, stop=[stop])).json()
    n = cut["usage"]["completion_tokens"]
    entries = cut["choices"][0]["logprobs"]["content"]
    assert cut["choices"][0]["finish_reason"] == "stop" and n < full["usage"]["completion_tokens"]
    assert len(entries) == n and entries == full["choices"][0]["logprobs"]["content"][:n]
    # streamed: the same entries, spread over the chunks
    assert streamed_entries(stream(client, C, chat(logprobs=True, top_logprobs=1, max_tokens=60, stop=[stop]))) \
        == entries


def test_streamed_logprobs_and_timings_agree_with_the_answer(served):
    _, client = served
    body = chat(logprobs=True, top_logprobs=2, max_tokens=100)  # up to two blocks of the demo's 64
    whole = client.post(C, json=body).json()
    chunks = stream(client, C, body)
    assert streamed_entries(chunks) == whole["choices"][0]["logprobs"]["content"]
    assert "timings" in chunks[-1] and all("timings" not in c for c in chunks[:-1])
    usage_chunks = stream(client, C, {**body, "stream_options": {"include_usage": True}})
    assert "usage" in usage_chunks[-1] and "timings" in usage_chunks[-1]
    for t, usage in ((whole["timings"], whole["usage"]), (chunks[-1]["timings"], whole["usage"])):
        d = t["diffusion"]
        assert t["predicted_n"] == usage["completion_tokens"] and t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"]
        assert d["blocks"] == len(d["steps_per_block"]) >= 1 and d["steps"] == sum(d["steps_per_block"]) <= 2 * 2
        assert d["canvas_tokens"] == 64 and d["ms_per_step"] > 0 and t["prompt_ms"] > 0 and t["predicted_ms"] > 0
        assert d["canvas_tokens_per_second"] == pytest.approx(64 * 1000 / d["ms_per_step"], rel=0.01)
        assert t["predicted_per_second"] == pytest.approx(1000 * t["predicted_n"] / t["predicted_ms"], rel=0.01)
        assert t["predicted_ms"] >= d["ms_per_step"] * d["steps"] * 0.99


def test_metrics_and_the_log_count_the_steps_the_timings_report(served):
    """A stop string ends the generator before the core's summary: its steps are counted still."""
    _, client = served
    text = client.post(C, json=chat(max_tokens=60)).json()["choices"][0]["message"]["content"]

    def steps_total() -> float:
        m = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith("mlx_dgemma_denoising_steps_total")]
        return float(m[0].split()[1])

    before = steps_total()
    r = client.post(C, json=chat(max_tokens=60, stop=[first_unique(text)])).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert steps_total() - before == r["timings"]["diffusion"]["steps"] > 0


def test_the_openai_client_reads_them(served):
    openai = pytest.importorskip("openai")
    _, client = served
    oa = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)
    r = oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
                                   logprobs=True, top_logprobs=2, extra_body=FAST)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    assert all(len(c.top_logprobs) == 2 and isinstance(c.bytes, list) for c in content)
    chunks = list(oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
                                             logprobs=True, top_logprobs=2, extra_body=FAST, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_text_completions_give_the_legacy_columns(served):
    _, client = served
    body = {"prompt": "And God said", "max_tokens": 12, "logprobs": 2, **FAST}
    r = client.post(X, json=body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == r["usage"]["completion_tokens"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(len(d) <= 2 and max(d.values()) >= v - 1e-6 for d, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    chunks = stream(client, X, body)
    cols = [c["choices"][0]["logprobs"] for c in chunks if c.get("choices") and c["choices"][0]["logprobs"]]
    assert [t for c in cols for t in c["tokens"]] == lp["tokens"]
    assert [o for c in cols for o in c["text_offset"]] == lp["text_offset"]
    assert "timings" in r and "timings" in chunks[-1]


def test_a_text_completion_keeps_its_whitespace_so_tokens_and_offsets_match_the_text(served):
    """A completion continues the prompt: its text is what the tokens spell, leading space
    included (the demo continues "And God said" with " ..."), so ``text_offset`` indexes it."""
    _, client = served
    r = client.post(X, json={"prompt": "And God said", "max_tokens": 4, "logprobs": 1, **FAST}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length" and len(lp["tokens"]) == 4
    assert lp["tokens"][0].startswith(" ")  # else this test checks nothing
    assert choice["text"] == "".join(lp["tokens"])
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
    streamed = "".join(c["choices"][0]["text"] for c in stream(client, X, {"prompt": "And God said", "max_tokens": 4,
                                                                             **FAST}) if c.get("choices"))
    assert streamed == choice["text"]


@pytest.mark.parametrize("path, patch, param", [
    (C, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (C, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (C, {"logprobs": 1}, "logprobs"),  # chat's is a boolean
    (X, {"logprobs": 6}, "logprobs"),
    (X, {"echo": True}, "echo"),
    (X, {"best_of": 3}, "best_of"),  # the legacy API's other fields: refused, never silently ignored
    (X, {"suffix": " world"}, "suffix"),
])
def test_bad_logprob_fields_are_400_naming_the_field(served, path, patch, param):
    _, client = served
    base = chat() if path == C else {"prompt": "Hi", **FAST}
    r = client.post(path, json={**base, **patch})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_echo_false_is_accepted(served):
    _, client = served
    assert client.post(X, json={"prompt": "Hi", "max_tokens": 4, "echo": False, **FAST}).status_code == 200
    assert client.post(X, json={"prompt": "Hi", "max_tokens": 4, "best_of": 1, "suffix": "", **FAST}).status_code == 200


def test_token_bytes_of_byte_fallback_and_spaces(served):
    engine, _ = served
    tok: Tokenizer = engine.tokenizer
    byte_id = tok.tokens.index("<0xE2>")
    assert tok.token_bytes(byte_id) == b"\xe2"
    word = tok.encode(" the")
    assert b"".join(tok.token_bytes(t) for t in word) == b" the"
