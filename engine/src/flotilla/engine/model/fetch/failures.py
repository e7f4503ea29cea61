"""One-line causes for failed downloads: HTTP statuses, socket errors and full disks, found anywhere in an
exception's chain (libraries wrap the error worth naming in their own types)."""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator


def describe_http_status(status: int, where: str) -> str:
    if status == 404:
        return f"not found (HTTP 404 from {where})"
    if status in (401, 403):
        return f"access denied (HTTP {status} from {where}); check the credentials (HF_TOKEN for the Hub)"
    return f"HTTP {status} from {where}"


def describe_network_error(error: BaseException, where: str) -> str | None:
    """A message for a socket-level failure anywhere in `error`'s chain, or None when it is not one."""
    for cause in exception_chain(error):
        if isinstance(cause, ConnectionRefusedError):
            return f"cannot connect to {where}: connection refused"
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host of {where}"
        if isinstance(cause, TimeoutError):
            return f"timed out talking to {where}"
        # httpx re-raises the socket error as its own ConnectError and drops the original from the chain.
        if type(cause).__name__ in ("ConnectError", "ConnectTimeout"):
            return f"cannot connect to {where}: {_strip_errno(first_line(str(cause))).lower()}"
    return None


def is_disk_full(error: BaseException) -> bool:
    return any(isinstance(cause, OSError) and cause.errno == errno.ENOSPC for cause in exception_chain(error))


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """The error and what caused it: libraries wrap the socket error we want to name in their own types."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _strip_errno(text: str) -> str:
    return re.sub(r"^\[Errno -?\d+\]\s*", "", text)
