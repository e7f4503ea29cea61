"""A minimal HTTP/1.1 client over one keep-alive connection, on asyncio streams.

The overhead benchmark measures a millisecond or less of gateway time and drives a gateway at its
ceiling: the client's own cost per request must be small next to both, and httpx's is not (hundreds of
microseconds). This one only writes a request with a body and reads a response framed by Content-Length
or chunked encoding, which is all the engine, the gateway and the stub answer with."""

from __future__ import annotations

import asyncio
import contextlib


class HTTPError(Exception):
    pass


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self.reader, self.writer

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """(status, body). A connection the server closed is reopened for the next request."""
        reader, writer = await self._connect()
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        try:
            status, headers = await read_head(reader)
            if headers.get("transfer-encoding", "").lower() == "chunked":
                data = await read_chunked(reader)
            else:
                data = await reader.readexactly(int(headers.get("content-length", "0")))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self.close()
            raise HTTPError(f"{method} {path}: the connection broke: {exc!r}") from exc
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, data

    async def close(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise HTTPError(f"not an HTTP response: {status_line!r}")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
