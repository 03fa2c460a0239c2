"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the frontend reports goes through `APIError`, so one serializer renders them all
and no client ever sees Falcon's own error body, a 422 or a traceback.
"""
from __future__ import annotations

import re

import msgspec

# OpenAI's `type` for each status we send (vLLM uses the same strings).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An HTTP error to report to the client in OpenAI's format."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def to_json(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": type, "param": param, "code": code}})


def engine_error(exc: Exception) -> APIError:
    """The engine failed the request (or died while it ran): a 500, or the error event that
    ends a stream, with the same body either way."""
    return APIError(500, str(exc), code="engine_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# msgspec says where a field failed as "- at `$.a.b[0]`"; OpenAI's `param` is that path.
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def from_validation_error(exc: Exception) -> APIError:
    """A 400 for a msgspec decode/validation failure, with `param` naming the field (a missing
    one too: msgspec names it in the message, and where it is missing in the path)."""
    text = str(exc)
    m = _AT.search(text)
    param = m.group(1) or None if m else None
    missing = _MISSING.match(text)
    if missing is not None:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return bad_request(text, param=param)
