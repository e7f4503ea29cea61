"""An OpenAI upstream that answers at once, for the gateway's throughput ceiling (`bench overhead`): the
engine is far slower than the gateway, so behind a real one the gateway's own limit never shows.

`python -m flotilla.bench.gateway.stub --port P`: plain asyncio (no framework to cost time), keep-alive
HTTP/1.1; `/v1/completions` and `/v1/chat/completions` answer a fixed JSON body, /health 200, everything
else (the tokenizer, /metrics) 404, so the gateway routes by load alone."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

from flotilla.contract import FLAG_HOST, FLAG_PORT, HEALTH_PATH, OPENAI_PATH

USAGE = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
COMPLETION = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}], "usage": USAGE,
}).encode()  # fmt: skip
CHAT = json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": USAGE,
}).encode()  # fmt: skip
ROUTES = {
    ("POST", OPENAI_PATH + "/completions"): (200, COMPLETION),
    ("POST", OPENAI_PATH + "/chat/completions"): (200, CHAT),
    ("GET", HEALTH_PATH): (200, b'{"status":"ok"}'),
}
NOT_FOUND = (404, b'{"error":{"message":"not found"}}')
REASONS = {200: b"OK", 404: b"Not Found"}


def answer(method: str, path: str) -> bytes:
    status, body = ROUTES.get((method, path.split("?", 1)[0]), NOT_FOUND)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (status, REASONS[status], len(body))) + body  # fmt: skip


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, path = (request_line.split(" ") + ["", ""])[:2]
            length = 0
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip() or 0)
            if length:
                await reader.readexactly(length)
            writer.write(answer(method, path))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def main(host: str, port: int) -> None:
    server = await asyncio.start_server(serve_connection, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(FLAG_HOST, default="127.0.0.1")
    parser.add_argument(FLAG_PORT, type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(args.host, args.port))
