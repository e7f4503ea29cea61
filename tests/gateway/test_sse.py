"""Where a stream first carries output: the gateway's commit point."""

from __future__ import annotations

import json

from flotilla.gateway.core.sse import event_has_output, has_output


def _event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def test_only_events_with_output_commit():
    role = _event(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    )
    token = _event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    text = _event({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})
    finish = _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert not event_has_output(role) and not event_has_output(b": waiting for a replica\n\n")
    assert all(event_has_output(e) for e in (token, text, finish, b"data: [DONE]\n\n",
                                                _event({"error": {"message": "x"}}), _event({"usage": {"x": 1}})))  # fmt: skip
    # Only complete events count: half a token event is not yet output.
    assert not has_output(role + token[:10]) and has_output(role + token)
