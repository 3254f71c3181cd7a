"""Refusals, in the shape of the API asked: OpenAI's {"error": {message, type,
param, code}}, Ollama's {"error": message} or Anthropic's {"type": "error",
"error": {type, message}}; and the checks request parsers
share."""
from __future__ import annotations

import math

OPENAI, OLLAMA, ANTHROPIC = "openai", "ollama", "anthropic"   # error shapes
# Anthropic's error types by status (its API's error shape names the kind, not the field).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


class ApiError(Exception):
    """A refusal answered with ``status`` and a body in the caller's API shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self, shape: str = OPENAI) -> dict:
        if shape == OLLAMA:
            return {"error": self.message}
        if shape == ANTHROPIC:
            kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error")


def bad(param: str, message: str) -> ApiError:
    """A 400 naming the request field at fault."""
    return ApiError(400, message, param=param)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite JSON number (an integer may be too large for a float: finite all the same)."""
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def show(value, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
