"""Tool calling on the server: tools and tool messages rendered in Gemma 4's format, tool calls
parsed out of the answer into OpenAI's ``tool_calls``, streamed as OpenAI streams them, and an
agent loop through the official ``openai`` client (the demo model does not call tools by
itself: its generator is replaced at the core boundary by a scripted one)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_dgemma.chat_template import ToolCall, parse_answer, render_chat, split_tool_calls

Q = '<|"|>'  # Gemma 4's string delimiter token

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


# --------------------------------------------------------------------------- rendering

def test_tools_are_declared_in_the_system_turn_in_gemma4_format():
    text = render_chat([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    # Gemma 4's documented declaration: declaration:NAME{description:...,parameters:{...}} with
    # sorted bare keys, strings between <|"|>, schema types upper-case
    decl = ("<|tool>declaration:get_weather{description:" + Q + "Current weather of a city" + Q +
            ",parameters:{properties:{city:{description:" + Q + "City name" + Q + ",type:" + Q + "STRING" + Q +
            "},days:{type:" + Q + "INTEGER" + Q + "}},required:[" + Q + "city" + Q + "],type:" + Q + "OBJECT" +
            Q + "}}<tool|>")
    assert text == ("<bos><|turn>system\n" + decl + "<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n"
                    "<|turn>model\n<|channel>thought\n<channel|>")


def test_a_tool_call_and_its_result_render_in_the_model_turn():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2,
                                                                                   "metric": True}}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny, 21 C"}]
    text = render_chat(messages)
    # the call in the model's turn, the result right after it, and the model goes on in the
    # same turn: no closing <turn|>, no new generation prompt (transformers' serving parser
    # anchors a Gemma 4 answer at "<tool_response|>" for this reason)
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
                    "<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + ",days:2,metric:true}<tool_call|>"
                    "<|tool_response>response:get_weather{value:" + Q + "sunny, 21 C" + Q + "}<tool_response|>")
    # the model's final answer continues that turn, and closes it
    after = render_chat(messages + [{"role": "assistant", "content": "Sunny."},
                                    {"role": "user", "content": "Thanks"}])
    assert after.startswith(text) and after[len(text):] == ("Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n"
                                                            "<|turn>model\n<|channel>thought\n<channel|>")


def test_plain_conversations_render_as_before():
    # no tools: the turn format is unchanged (the chat session's cache relies on it)
    messages = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    assert render_chat(messages) == ("<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n<|turn>user\nBye"
                                     "<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")


# --------------------------------------------------------------------------- parsing

def test_one_call_is_parsed_into_json_arguments():
    pieces, is_open = split_tool_calls("<|tool_call>call:get_weather{city:" + Q + "Paris, FR" + Q +
                                       ",days:3,opts:{metric:true,tags:[" + Q + "a" + Q + ",null,-1.5]}}"
                                       "<tool_call|>")
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert not is_open and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris, FR", "days": 3,
                                              "opts": {"metric": True, "tags": ["a", None, -1.5]}}


def test_several_calls_and_the_text_around_them():
    text = ("Let me check.<|tool_call>call:a{x:1}<tool_call|><|tool_call>call:b{}<tool_call|> Done"
            "<|tool_call>call:c{y:" + Q + "half")
    pieces, is_open = split_tool_calls(text)
    assert [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)] == [("a", {"x": 1}),
                                                                                            ("b", {})]
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me check. Done"
    assert is_open  # the unclosed third call is held back, not text


@pytest.mark.parametrize("answer", [
    "Let me check.<|tool_call>call:get_weather{city:" + Q + "Paris, FR" + Q + ",days:3}<tool_call|>",
    "<|tool_call>call:a{x:-1.5,y:[" + Q + "p" + Q + ",true,null],z:{k:" + Q + "v: w" + Q + "}}<tool_call|>"
    "<|tool_call>call:b{}<tool_call|><|tool_response>",
    "No call here.<turn|>",
])
def test_calls_are_parsed_as_transformers_parses_gemma4(answer):
    # the reference: transformers' serving parser for Gemma 4 answers
    utils = pytest.importorskip("transformers.cli.serving.utils")
    from transformers.utils.chat_parsing.response_parser import parse_response

    ref = parse_response(answer, utils._RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)], prefix="<|turn>model\n")
    pieces, is_open = split_tool_calls(answer)
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    assert not is_open
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in ref.get("tool_calls", [])]
    assert parse_answer("".join(p for p in pieces if isinstance(p, str))).answer == ref.get("content", "")


@pytest.mark.parametrize("body", ["call:f{a:}", "call:f{a:" + Q + "x}", "call:f[1]", "f{a:1}", "call:f{a:1}}",
                                  "call:f{a:tru}"])
def test_malformed_arguments_stay_text(body):
    block = "<|tool_call>" + body + "<tool_call|>"
    pieces, is_open = split_tool_calls("x" + block)
    assert not is_open and pieces == ["x", block, ""]


def test_the_answer_holds_calls_and_text_apart():
    from mlx_dgemma.loader import open_model
    from mlx_dgemma.server.openai import Answer

    tok = open_model(None, True, "auto", None).tokenizer
    text = "Checking.<|tool_call>call:f{q:" + Q + "x" + Q + "}<tool_call|><|tool_call>call:g{a:}<tool_call|>"
    ids = tok.encode(text) + tok.encode("<|tool_response>")
    a = Answer(tok, (1,), tools=True)
    a.add(tuple(ids), parse_answer(tok.decode(ids)).answer, "")
    assert [(c.name, c.arguments) for c in a.tool_calls] == [("f", '{"q": "x"}')]
    # the malformed call is returned as text, verbatim; the answer ends at <|tool_response>
    assert a.content == "Checking.<|tool_call>call:g{a:}<tool_call|>"
    assert a.eos and a.finish_reason == "tool_calls" and a.completion_tokens == len(ids)


# --------------------------------------------------------------------------- the server

class Script:
    """Stands in for the core's generate: answers each prompt with the next scripted text, in
    canvas-sized blocks, and records the prompts it was given (decoded)."""

    def __init__(self, engine: Any, answers: list[str]):
        self.engine, self.answers, self.prompts = engine, list(answers), []

    def __call__(self, prompt: list[int], *, cancel: Any = None, chat: bool = True, **params: Any):
        from mlx_dgemma.events import BlockEvent, DoneEvent, PrefillEvent

        tok, C = self.engine.tokenizer, self.engine.canvas
        self.prompts.append(tok.decode(prompt))
        ids = tok.encode(self.answers.pop(0)) + [1]  # <eos>
        ids += [0] * (-len(ids) % C)  # padding after EOS, as a committed canvas holds
        yield PrefillEvent(tokens=len(prompt), seconds=0.0)
        n = len(ids) // C
        for b in range(n):
            so_far = tok.decode(ids[: (b + 1) * C])
            p = parse_answer(so_far)
            yield BlockEvent(block=b + 1, tokens=tuple(ids[b * C:(b + 1) * C]), steps=1, finished=b == n - 1,
                             text=p.answer, thinking=p.thinking, raw_text=so_far)
        yield DoneEvent(text=p.answer, thinking=p.thinking, tokens=tuple(ids), finish_reason="eos",
                        prompt_tokens=len(prompt), prefill_seconds=0.0, prefill_tokens_per_second=0.0, steps=n,
                        steps_per_block=(1,) * n, seconds_per_step=0.0, tokens_per_forward=1.0,
                        generation_seconds=0.0, peak_memory_bytes=0)


def call_text(name: str, **args: Any) -> str:
    body = ",".join(f"{k}:{Q}{v}{Q}" if isinstance(v, str) else f"{k}:{json.dumps(v)}" for k, v in args.items())
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


def openai_client(client: Any) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)


def test_an_agent_loop_runs_to_the_end_with_the_openai_client(served, monkeypatch):
    engine, client = served
    turns = 20  # the issue's target: a 20-step agent loop
    script = Script(engine, [call_text("get_weather", city=f"city{i}", days=i) for i in range(turns)]
                    + ["It is sunny everywhere."])
    monkeypatch.setattr(engine.runtime, "generate", script)
    oa = openai_client(client)
    messages: list[Any] = [{"role": "user", "content": "Weather in twenty cities?"}]
    for i in range(turns):
        r = oa.chat.completions.create(model="anything", messages=messages, tools=[WEATHER], max_tokens=128)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": f"city{i}", "days": i}
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny {i}"})
        # the model saw every earlier call and result, in the template's format
        assert script.prompts[-1].count("<|tool_response>") == i
    r = oa.chat.completions.create(model="anything", messages=messages, tools=[WEATHER], max_tokens=128)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "It is sunny everywhere."
    assert not r.choices[0].message.tool_calls
    last = script.prompts[-1]
    assert last.endswith("<|tool_response>response:get_weather{value:" + Q + f"sunny {turns - 1}" + Q +
                         "}<tool_response|>")
    assert last.count("<|tool_call>call:get_weather{city:") == turns and "<|tool>declaration:get_weather" in last


def test_a_streamed_tool_call_arrives_as_openai_sends_it(served, monkeypatch):
    engine, client = served
    script = Script(engine, ["Let me look." + call_text("get_weather", city="Oslo")])
    monkeypatch.setattr(engine.runtime, "generate", script)
    stream = openai_client(client).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER], stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert text == "Let me look."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_malformed_arguments_come_back_as_text(served, monkeypatch):
    engine, client = served
    bad = "<|tool_call>call:get_weather{city:}<tool_call|>"
    monkeypatch.setattr(engine.runtime, "generate", Script(engine, [bad]))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "?"}], "tools": [WEATHER]})
    assert r.status_code == 200
    msg = r.json()["choices"][0]
    assert msg["message"]["content"] == bad and "tool_calls" not in msg["message"] and msg["finish_reason"] == "stop"


def test_tool_choice_none_and_named(served):
    # the real demo model, one short block: the declarations' size shows in prompt_tokens
    _, client = served
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                   "properties": {}}}}
    base = {"messages": [{"role": "user", "content": "?"}], "max_tokens": 4, "max_denoising_steps": 1, "seed": 0}

    def prompt_tokens(**extra: Any) -> int:
        r = client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain, both = prompt_tokens(), prompt_tokens(tools=[WEATHER, other])
    none = prompt_tokens(tools=[WEATHER, other], tool_choice="none")
    named = prompt_tokens(tools=[WEATHER, other], tool_choice={"type": "function", "function": {"name": "get_time"}})
    auto = prompt_tokens(tools=[WEATHER, other], tool_choice="auto")
    assert none == plain and auto == both and plain < named < both


@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),  # a call, but no tool to call
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "?"}, {"role": "tool", "tool_call_id": "zz", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "?"},
                   {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]},
                   {"role": "tool", "tool_call_id": "a", "content": "1"}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_400_naming_the_field(served, patch, param):
    _, client = served
    body = {"messages": [{"role": "user", "content": "?"}], "tools": [WEATHER], **patch}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":")


def test_the_demo_model_answers_a_request_with_tools(served):
    # the real generator (no script): a request with tools and a tool result runs end to end
    _, client = served
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "rain"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 8,
                                                  "max_denoising_steps": 2, "seed": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert r.json()["usage"]["completion_tokens"] <= 8


# --------------------------------------------------------------------------- forced calls (issue 31)

TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                        "required": ["zone"]}}}


def test_a_named_call_is_fixed_on_the_canvas_and_kept_when_it_validates(served, monkeypatch):
    engine, client = served
    script = Script(engine, [call_text("get_weather", city="Oslo", days=2)])
    seen: list[Any] = []

    def generate(prompt, **kw):
        seen.append(kw["request"].template.fixed)
        return script(prompt, **kw)

    monkeypatch.setattr(engine.runtime, "generate", generate)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Oslo?"}],
                                                  "tools": [WEATHER, TIME], "max_tokens": 128,
                                                  "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    # one pass (the call validated), its opening fixed from the answer's first position on
    (template,) = seen
    assert [p for p, _ in template] == list(range(len(template)))
    assert engine.tokenizer.decode([t for _, t in template]) == "<|tool_call>call:get_weather{"


def test_a_call_that_does_not_validate_gets_one_repair_pass(served, monkeypatch):
    engine, client = served
    from mlx_dgemma.canvas import CanvasTemplate
    from mlx_dgemma.server.toolcalls import Frame

    frame = Frame.of(WEATHER)
    tok = engine.tokenizer
    template = CanvasTemplate.from_pieces(tok, frame.pieces)
    (a, b), = frame.hole_spans(tok.encode)
    # the repair pass' answer: the frame, its hole filled with the city and padding after it
    filled = dict(template.fixed)
    city = tok.encode("Rome")
    answer = [filled[i] if i in filled else city[i - a] if a <= i < a + len(city) else 0 for i in range(template.end)]
    texts = [call_text("get_weather", days=3), tok.decode(answer)]  # the first misses the required city
    seen: list[Any] = []

    def generate(prompt, **kw):
        seen.append(kw["request"].template.fixed)
        return Script(engine, [texts[len(seen) - 1]])(prompt, **kw)

    monkeypatch.setattr(engine.runtime, "generate", generate)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Rome?"}],
                                                  "tools": [WEATHER], "tool_choice": "required", "max_tokens": 256})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert len(seen) == 2 and [t for _, t in seen[1]] == [t for _, t in template.fixed]
    assert tok.decode([t for _, t in seen[0]]) == "<|tool_call>call:"  # required: the model writes the name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_demo_model_answers_a_forced_call_with_valid_arguments(served, seed):
    # the real demo model (trained on the King James Bible, never on tool calls): the canvas
    # holds the call's frame, so its arguments parse and validate against the schema
    from mlx_dgemma.server.toolcalls import validate

    _, client = served
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": seed,
        "max_denoising_steps": 4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and validate(args, WEATHER["function"]["parameters"]) is None


def test_a_required_call_names_a_declared_tool_on_the_demo_model(served):
    _, client = served
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}], "tools": [WEATHER, TIME],
        "tool_choice": "required", "seed": 0, "max_denoising_steps": 4})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    json.loads(call["function"]["arguments"])


def test_the_schema_subset_tools_use():
    from mlx_dgemma.server.toolcalls import validate

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}, "unit": {"enum": ["c", "f"]},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["n"], "additionalProperties": False}
    assert validate({"n": 2, "unit": "c", "tags": ["a"]}, schema) is None
    assert "required" in validate({}, schema)
    assert "integer" in validate({"n": "2"}, schema) and "minimum" in validate({"n": 0}, schema)
    assert "one of" in validate({"n": 1, "unit": "k"}, schema)
    assert "tags[0]" in validate({"n": 1, "tags": [1]}, schema)
    assert "not a declared property" in validate({"n": 1, "x": 1}, schema)
    assert validate(True, {"type": "integer"}) is not None  # JSON's true is no integer


def test_a_frame_reads_each_type_from_its_hole():
    from mlx_dgemma.server.toolcalls import Frame

    class Tok:  # one token per character; 0 is the padding (a special, skipped)
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special=False):
            return "".join(chr(i) for i in ids if i or not skip_special)

    tool = {"function": {"name": "f", "parameters": {"type": "object", "required": ["a", "b", "c", "d"],
                                                     "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                                                                    "c": {"type": "boolean"},
                                                                    "d": {"type": "array", "items": {"type": "number"}}}}}}
    frame = Frame.of(tool)
    assert frame.holes == ["string", "integer", "boolean", "number"]
    tok = Tok()
    values = ["Oslo", "12x", "t", "-1.5"]
    tokens: list[int] = []
    holes = iter(values)
    for p in frame.pieces:
        if isinstance(p, str):
            tokens += tok.encode(p)
        else:
            v = tok.encode(next(holes))[:p]
            tokens += v + [0] * (p - len(v))
    # the boolean's one position holds "t": not true/false, so it stays text (and fails validation)
    assert frame.arguments(tokens, tok) == {"a": "Oslo", "b": 12, "c": "t", "d": [-1.5]}


def test_a_forced_calls_template_gets_the_room_it_needs_or_none():
    # Shaping.room_for (request shaping, on no model): a template's positions within the request's
    # blocks keep the request; beyond them, more blocks where the context and max_tokens allow,
    # the prompt counted only then; else None (the engine returns the first pass as it is)
    from mlx_dgemma.request import GenerationRequest
    from mlx_dgemma.server.shaping import Shaping

    class Model(Shaping):  # the facts a loaded model gives the engine (its host's ModelInfo)
        canvas, context, generation_config = 64, 1000, {"max_new_tokens": 64}

    engine = Model()
    request = GenerationRequest.of({"max_new_tokens": 64})
    counted: list[int] = []

    def prompt_tokens() -> int:
        counted.append(1)
        return 100

    assert engine.room_for(request, 50, None, prompt_tokens) is request and counted == []
    assert engine.room_for(request, 100, None, prompt_tokens).get("max_new_tokens") == 128 and counted == [1]
    assert engine.room_for(request, 100, 90, prompt_tokens) is None  # max_tokens below the template
    assert engine.room_for(request, 960, None, prompt_tokens) is None  # 100 + 960 beyond the context
