"""OpenAI-shaped errors: every refusal the gateway makes itself has the body OpenAI's clients parse
(`{"error": {"message", "type", "param", "code"}}`, built by flotilla.openai_errors, as the engine's are),
and is made before any upstream call."""

from __future__ import annotations

import json

from starlette.responses import Response

from flotilla.openai_errors import OpenAIError


class GatewayError(OpenAIError):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, code=code, param=param, headers=headers)

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
