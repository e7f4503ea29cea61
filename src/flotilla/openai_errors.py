"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: the one builder of it.

The engine's server and the gateway both answer refusals in the shape OpenAI's clients parse, and two
copies of it once disagreed (a 404 was `invalid_request_error` in one, `not_found_error` in the other).
Both now subclass `OpenAIError` (stdlib only, so either half may import it; tests/test_layout.py fails on
a second copy of the type names). The type follows OpenAI's own API: an unknown model is a 404 of type
`invalid_request_error` with code `model_not_found`; 401, 403 and 429 have types of their own; every
other refusal below 500 is an `invalid_request_error`, and 500 and above a `server_error`.
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """The `type` OpenAI gives an error of this HTTP status."""
    return _TYPES.get(status, SERVER_ERROR if status >= 500 else INVALID_REQUEST)


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: its status, body and the headers to answer it with (Retry-After).
    Each half adds the response of its own web framework."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)
