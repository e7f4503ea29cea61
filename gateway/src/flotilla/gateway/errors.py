"""OpenAI-shaped errors: every refusal the gateway makes itself has the body OpenAI's clients parse
(`{"error": {"message", "type", "param", "code"}}`), and is made before any upstream call."""

from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )

    def sse(self) -> bytes:
        """The same error as one SSE event, for a stream whose headers already went out (a held request)."""
        return f"data: {json.dumps(self.body())}\n\ndata: [DONE]\n\n".encode()
