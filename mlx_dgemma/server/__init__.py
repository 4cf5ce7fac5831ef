"""``mlx-dgemma serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

- :mod:`.schemas`: the request bodies (pydantic; the sampler fields' ranges are the core's);
- :mod:`.openai`: the answer as the client sees it, stream deltas, response objects;
- :mod:`.shaping`: requests checked and shaped for the core (context, work budget, tools);
- :mod:`.endpoints`: the generating endpoints, each declared once (path, body, shaper, formatter);
- :mod:`.toolcalls`: forced tool calls held on the canvas, their arguments checked and repaired;
- :mod:`.engine`: requests run on the core's model worker, taking turns at block boundaries;
- :mod:`.app`: the FastAPI app (lifespan, ``app.state.engine`` via ``Depends``, error handlers,
  request log, CORS, the request guard, body limit);
- :mod:`.guard`: who may talk to the server (Host, Origin, API key, Content-Type; the connection
  guard: room for newcomers, deadlines, malformed HTTP as JSON);
- :mod:`.cli`: the flags, the listening socket, uvicorn.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (each also
without ``/v1``), ``GET /props``, ``GET /metrics``, ``GET /health`` (GET routes answer HEAD too).
Errors are OpenAI-style JSON objects.
Names are imported lazily: ``mlx-dgemma --help`` loads :mod:`.cli` only, not FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Answer": "openai", "Deltas": "openai", "Formatter": "openai", "Result": "openai",
         "Engine": "engine", "Job": "engine", "Limits": "engine", "load_model": "engine",
         "create_app": "app", "Settings": "app", "APIError": "errors",
         "main": "cli", "add_args": "cli", "check_args": "cli"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
