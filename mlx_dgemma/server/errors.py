"""The server's errors: each is answered as an OpenAI-style ``{"error": {...}}`` object."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as an OpenAI-style ``{"error": {...}}`` object with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContextLengthError(APIError):
    """The prompt and one block of answer do not fit the model's context: a 400 with OpenAI's
    ``context_length_exceeded`` code (the openai, litellm and langchain clients raise their
    context errors on it; a 413 they took for a generic status error)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(400, message, param=param, code="context_length_exceeded")
