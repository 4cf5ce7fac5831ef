"""Record the request bodies that openai, litellm and langchain-openai send for issue 31's cases.

    python scripts/record_client_requests.py tests/data/client_requests.json

Needs the three clients installed (``pip install openai litellm langchain-openai``; not test
dependencies). A recording server on 127.0.0.1 answers each request with a canned tool call or
stream and keeps its body; each client then makes the cases tests/test_server_agents.py replays:
a forced named call, a required call, a tool-result round trip, a stream with usage (and, for
langchain, ``with_structured_output(method="function_calling")``, whose parse of the canned
answer fails: only its body is wanted). Re-record it when a client's release changes what it sends.
"""
import json
import os
import sys
import threading

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for its price list
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

bodies = []
CALL = {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            "finish_reason": "tool_calls", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

class H(BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(n))
        bodies.append({"path": self.path, "body": body})
        if body.get("stream"):
            self.send_response(200); self.send_header("content-type", "text/event-stream"); self.end_headers()
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            chunk["choices"][0] = {"index": 0, "delta": {}, "finish_reason": "stop"}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(f"data: {json.dumps({**chunk, 'choices': [], 'usage': CALL['usage']})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        data = json.dumps(CALL).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def log_message(self, *a): pass

srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{srv.server_address[1]}/v1"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ROUND = USER + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

out = {}
def take(client, case):
    out.setdefault(client, {})[case] = bodies.pop()["body"]

import litellm
kw = dict(model="openai/mlx-dgemma-demo", api_base=url, api_key="unused")
litellm.completion(messages=USER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw); take("litellm", "named")
litellm.completion(messages=USER, tools=[WEATHER], tool_choice="required", **kw); take("litellm", "required")
litellm.completion(messages=ROUND, tools=[WEATHER], **kw); take("litellm", "round_trip")
list(litellm.completion(messages=USER, stream=True, stream_options={"include_usage": True}, **kw)); take("litellm", "stream_usage")

from langchain_openai import ChatOpenAI
from langchain_core.messages import HumanMessage, AIMessage, ToolMessage
from pydantic import BaseModel, Field
llm = ChatOpenAI(model="mlx-dgemma-demo", base_url=url, api_key="unused", max_retries=0)
class GetWeather(BaseModel):
    """Current weather of a city"""
    city: str = Field(description="City name")
llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?"); take("langchain", "named")
llm.bind_tools([GetWeather], tool_choice="any").invoke("What is the weather in Paris?"); take("langchain", "required")
bodies.clear()
try:
    llm.with_structured_output(GetWeather, method="function_calling").invoke("What is the weather in Paris?")
except Exception as e:
    print("structured", type(e).__name__, e)
take("langchain", "structured")
msgs = [HumanMessage("What is the weather in Paris?"), AIMessage("", tool_calls=[{"id": "call_1", "name": "GetWeather", "args": {"city": "Paris"}}]),
        ToolMessage("sunny, 21 C", tool_call_id="call_1")]
llm.bind_tools([GetWeather]).invoke(msgs); take("langchain", "round_trip")
list(ChatOpenAI(model="mlx-dgemma-demo", base_url=url, api_key="unused", stream_usage=True).stream("Hi")); take("langchain", "stream_usage")

import openai
oc = openai.OpenAI(base_url=url, api_key="unused")
oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}); take("openai", "named")
oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, tools=[WEATHER], tool_choice="required"); take("openai", "required")
oc.chat.completions.create(model="mlx-dgemma-demo", messages=ROUND, tools=[WEATHER]); take("openai", "round_trip")
list(oc.chat.completions.create(model="mlx-dgemma-demo", messages=USER, stream=True, stream_options={"include_usage": True})); take("openai", "stream_usage")
json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
print(f"recorded {sum(map(len, out.values()))} bodies to {sys.argv[1]}")
