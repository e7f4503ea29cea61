"""Times as the Kubernetes API writes them: RFC 3339 in UTC with a `Z`, to the second (metav1.Time:
conditions, container states) or to the microsecond (metav1.MicroTime: Lease renewals; and the operator's
and gateway's own annotations, where two writes within a second must differ). The one place such a time is
formatted or read (stdlib only, so every part may import it; tests/test_layout.py fails on a second copy
of the format).
"""

from __future__ import annotations

import datetime as dt

_SECONDS = "%Y-%m-%dT%H:%M:%SZ"
_MICROSECONDS = "%Y-%m-%dT%H:%M:%S.%fZ"


def format_time(moment: dt.datetime, *, micro: bool = False) -> str:
    """`moment` (an aware datetime) in UTC: 2030-01-01T00:00:00Z, or 2030-01-01T00:00:00.250000Z."""
    return moment.astimezone(dt.UTC).strftime(_MICROSECONDS if micro else _SECONDS)


def now(*, micro: bool = False) -> str:
    """The time now, RFC 3339 in UTC."""
    return format_time(dt.datetime.now(dt.UTC), micro=micro)


def from_epoch(epoch: float, *, micro: bool = False) -> str:
    """Seconds since the epoch, RFC 3339 in UTC."""
    return format_time(dt.datetime.fromtimestamp(epoch, dt.UTC), micro=micro)


def parse_time(text: str) -> dt.datetime:
    """An RFC 3339 time (a `Z` or `z`, or any offset) as an aware datetime; one without an offset, which
    RFC 3339 does not allow, is read as UTC. ValueError when it is not a time."""
    text = text.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    moment = dt.datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
