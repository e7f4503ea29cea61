"""Per-tenant rate limits: token buckets of requests and of tokens, with the clock passed in.

A Tenant's spec.rateLimits sets requestsPerSecond and tokensPerMinute; either may be absent (unlimited).
Requests are charged when admitted. Tokens are post-paid: a request is admitted while the tenant's token
bucket is above zero, and charged its prompt tokens once known and its completion tokens when done, so the
bucket may go below zero; the tenant then waits until it refills. A prompt's size is not known before the
gateway tokenizes it, and a completion's never before it ends, so charging after is the only exact way.

`now` is any monotonic clock in seconds (time.monotonic()); the limiter never reads one itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True)
class RateLimits:
    requests_per_second: float | None = None
    tokens_per_minute: int | None = None

    def kinds(self) -> list[LimitKind]:
        """The limits set, by the name a refusal carries."""
        set_: list[LimitKind] = []
        if self.requests_per_second is not None:
            set_.append("requests")
        if self.tokens_per_minute is not None:
            set_.append("tokens")
        return set_


UNLIMITED = RateLimits()


def rate_limits_of(tenant_obj: dict[str, Any] | None) -> RateLimits:
    """A Tenant's limits from its JSON. A missing, non-numeric or non-positive value is no limit: the CRD
    refuses those, so only a hand-edited object without validation could have one."""
    limits = ((tenant_obj or {}).get("spec") or {}).get("rateLimits") or {}
    rps = _positive(limits.get("requestsPerSecond"))
    tpm = _positive(limits.get("tokensPerMinute"))
    return RateLimits(requests_per_second=rps, tokens_per_minute=int(tpm) if tpm is not None else None)


def _positive(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value > 0 and math.isfinite(value) else None


@dataclass(frozen=True)
class Admitted:
    pass


ADMITTED = Admitted()


@dataclass(frozen=True)
class Limited:
    """429: `limit` is the label value of GATEWAY_RATE_LIMITED; `retry_after_seconds` the Retry-After."""

    limit: LimitKind
    retry_after_seconds: int
    message: str


@dataclass
class _Bucket:
    level: float
    capacity: float
    rate: float  # per second
    updated: float

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)  # a clock that steps back refills nothing, takes nothing
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.updated = max(self.updated, now)

    # Whole seconds to wait, at least 1 (Retry-After: 0 invites a busy loop of retries).
    def seconds_to_reach(self, target: float) -> int:
        return max(1, math.ceil((target - self.level) / self.rate))

    def seconds_to_exceed(self, target: float) -> int:
        return max(1, math.floor((target - self.level) / self.rate) + 1)


class RateLimiter:
    """The buckets of every tenant that has limits. A tenant's limits are passed on each admit, so an
    edited Tenant takes effect on its next request: a bucket keeps its level, cut to a smaller capacity."""

    def __init__(self) -> None:
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def admit(self, tenant: str, limits: RateLimits, now: float) -> Admitted | Limited:
        """Admit one request now (taking one from its request bucket), or say which limit refuses it and
        when to retry. Nothing is taken from a refused request's buckets."""
        requests = _sync(self._requests, tenant, request_shape(limits), now)
        tokens = _sync(self._tokens, tenant, token_shape(limits), now)
        refusals: list[Limited] = []
        if requests is not None and requests.level < 1:
            refusals.append(refusal("requests", requests.seconds_to_reach(1), tenant, limits))
        if tokens is not None and tokens.level <= 0:
            refusals.append(refusal("tokens", tokens.seconds_to_exceed(0), tenant, limits))
        if refusals:
            return max(refusals, key=lambda r: r.retry_after_seconds)
        if requests is not None:
            requests.level -= 1
        return ADMITTED

    def charge_tokens(self, tenant: str, n: int, now: float) -> None:
        """Take `n` tokens (prompt tokens once known, completion tokens when done) from the tenant's token
        bucket, below zero if need be. Nothing when the tenant has no token limit."""
        bucket = self._tokens.get(tenant)
        if bucket is not None and n > 0:
            bucket.refill(now)
            bucket.level -= n

    def forget(self, tenant: str) -> None:
        """The Tenant was deleted."""
        self._requests.pop(tenant, None)
        self._tokens.pop(tenant, None)


def refusal(limit: LimitKind, retry_after_seconds: int, tenant: str, limits: RateLimits) -> Limited:
    """The 429 of `limit`, worded once for every store of the buckets (gateway/tenant_limits.py too)."""
    if limit == "requests":
        what = f"{limits.requests_per_second:g} requests per second"
    else:
        what = f"{limits.tokens_per_minute} tokens per minute"
    return Limited(limit, retry_after_seconds, f"tenant {tenant} exceeded its rate limit of {what}")


def request_shape(limits: RateLimits) -> tuple[float, float] | None:
    """(capacity, rate): one second of requests as burst, and never less than one whole request."""
    rps = limits.requests_per_second
    return None if rps is None else (max(1.0, rps), rps)


def token_shape(limits: RateLimits) -> tuple[float, float] | None:
    """(capacity, rate): a minute's tokens as burst, refilled evenly over the minute."""
    tpm = limits.tokens_per_minute
    return None if tpm is None else (float(tpm), tpm / 60.0)


def _sync(
    buckets: dict[str, _Bucket], tenant: str, shape: tuple[float, float] | None, now: float
) -> _Bucket | None:
    """The tenant's bucket refilled to `now` under its current limit (created full, dropped if none)."""
    if shape is None:
        buckets.pop(tenant, None)
        return None
    capacity, rate = shape
    bucket = buckets.get(tenant)
    if bucket is None:
        bucket = buckets[tenant] = _Bucket(level=capacity, capacity=capacity, rate=rate, updated=now)
        return bucket
    bucket.refill(now)  # under the old rate up to now
    bucket.capacity, bucket.rate = capacity, rate
    bucket.level = min(bucket.level, capacity)
    return bucket
