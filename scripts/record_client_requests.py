"""Record the request bodies that openai, litellm and langchain-openai send for issue 31's cases.

    python scripts/record_client_requests.py tests/data/client_requests.json

Needs the three clients installed (``pip install openai litellm langchain-openai``; they are not
test dependencies). A recording server on 127.0.0.1 answers every request with a canned tool call
(or a short stream) and keeps its body; each client then makes the cases that
``tests/test_server_agents.py`` replays against the real server: a forced named call, a required
call, a tool-result round trip, a stream with usage (and langchain's
``with_structured_output(method="function_calling")``, whose parse of the canned answer fails:
only its body is wanted). Re-record when a client's release changes what it sends.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no network for its price list

USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
CALL = {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m", "usage": USAGE,
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}}]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ROUND = USER + [{"role": "assistant", "content": None, "tool_calls": CALL["choices"][0]["message"]["tool_calls"]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

bodies: list[dict[str, Any]] = []


class Recorder(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        bodies.append(body)
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            for chunk in ({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                                                "finish_reason": None}]},
                          {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                          {**base, "choices": [], "usage": USAGE}):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        data = json.dumps(CALL).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def record(url: str) -> dict[str, dict[str, Any]]:
    import litellm
    import openai
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    out: dict[str, dict[str, Any]] = {}

    def take(client: str, case: str) -> None:
        out.setdefault(client, {})[case] = bodies.pop()

    kw = {"model": "openai/mlx-dgemma-demo", "api_base": url, "api_key": "unused"}
    litellm.completion(messages=USER, tools=[WEATHER], tool_choice=NAMED, **kw)
    take("litellm", "named")
    litellm.completion(messages=USER, tools=[WEATHER], tool_choice="required", **kw)
    take("litellm", "required")
    litellm.completion(messages=ROUND, tools=[WEATHER], **kw)
    take("litellm", "round_trip")
    list(litellm.completion(messages=USER, stream=True, stream_options={"include_usage": True}, **kw))
    take("litellm", "stream_usage")

    class GetWeather(BaseModel):
        """Current weather of a city"""

        city: str = Field(description="City name")

    llm = ChatOpenAI(model="mlx-dgemma-demo", base_url=url, api_key="unused", max_retries=0)
    llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(USER[0]["content"])
    take("langchain", "named")
    llm.bind_tools([GetWeather], tool_choice="any").invoke(USER[0]["content"])
    take("langchain", "required")
    try:  # the canned call names get_weather, not GetWeather: the parse fails, the body is what counts
        llm.with_structured_output(GetWeather, method="function_calling").invoke(USER[0]["content"])
    except Exception:  # noqa: BLE001
        pass
    take("langchain", "structured")
    llm.bind_tools([GetWeather]).invoke([HumanMessage(USER[0]["content"]),
                                         AIMessage("", tool_calls=[{"id": "call_1", "name": "GetWeather",
                                                                    "args": {"city": "Paris"}}]),
                                         ToolMessage("sunny, 21 C", tool_call_id="call_1")])
    take("langchain", "round_trip")
    list(ChatOpenAI(model="mlx-dgemma-demo", base_url=url, api_key="unused", stream_usage=True).stream("Hi"))
    take("langchain", "stream_usage")

    oc = openai.OpenAI(base_url=url, api_key="unused")
    oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, tools=[WEATHER], tool_choice=NAMED)
    take("openai", "named")
    oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, tools=[WEATHER], tool_choice="required")
    take("openai", "required")
    oc.chat.completions.create(model="mlx-dgemma-demo", messages=ROUND, tools=[WEATHER])
    take("openai", "round_trip")
    list(oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, stream=True,
                                    stream_options={"include_usage": True}))
    take("openai", "stream_usage")
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = record(f"http://127.0.0.1:{server.server_address[1]}/v1")
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"recorded {sum(map(len, out.values()))} bodies to {sys.argv[1]}")


if __name__ == "__main__":
    main()
