"""Where an engine's event stream first carries output. Pure.

The gateway commits its response (sends the client 200 and the first bytes) only once the replica has
produced output: until then a replica that dies loses nothing the client saw, and the request goes to
another replica. An engine may open a stream with events that carry no output (a chat stream's first
chunk names the role only); those do not count.
"""

from __future__ import annotations

import json

EVENT_END = b"\n\n"


def _data(event: bytes) -> bytes:
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines)


def event_has_output(event: bytes) -> bool:
    """Whether one SSE event is output the client must see: a token, a finish, usage, an error, or the
    stream's end."""
    data = _data(event)
    if not data:
        return False  # a comment (heartbeat) or an empty event
    if data == b"[DONE]":
        return True
    try:
        payload = json.loads(data)
    except ValueError:
        return True  # not ours to judge: pass it on
    if not isinstance(payload, dict):
        return True
    if payload.get("error") or payload.get("usage"):
        return True
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        if (
            choice.get("text")
            or delta.get("content")
            or delta.get("tool_calls")
            or choice.get("finish_reason")
        ):
            return True
    return False


def has_output(buffer: bytes) -> bool:
    """Whether any complete event in the bytes read so far carries output."""
    *complete, _partial = buffer.split(EVENT_END)
    return any(event_has_output(event) for event in complete)
