"""Where a tenant's rate-limit buckets live: in this gateway process (one replica: `LocalLimits`), or in
Redis, shared by every gateway replica (`SharedLimits`), so that a tenant's limits are global however many
replicas the front door has.

The buckets are core/rate_limit.py's: requests taken on admission, tokens post-paid. In Redis each tenant
has two hashes (`flotilla:ratelimit:{tenant}:requests|tokens`, one hash slot per tenant for Redis
Cluster) updated by one Lua script per operation, atomically, on the Redis server's own clock (`TIME`):
replicas' clocks never meet. A key expires once its bucket would be full again, which is what a missing
key means.

When Redis cannot be reached (or answers an error), the request is decided by this replica's own buckets
instead, as if it were the only replica: the front door stays open with per-replica limits (a tenant may
then get up to N times its limits over N replicas), every failure is counted
(flotilla_gateway_rate_limit_store_errors_total, which an alert watches), and Redis is tried again after
RETRY_SECONDS. Failing closed would turn a cache outage into a full outage of every tenant's traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from flotilla.gateway.core.rate_limit import (
    ADMITTED,
    Admitted,
    Limited,
    RateLimiter,
    RateLimits,
    refusal,
    request_shape,
    token_shape,
)

log = logging.getLogger("flotilla.gateway.tenant_limits")
RETRY_SECONDS = 5.0  # after a store failure, decide locally this long before asking Redis again
STORE_TIMEOUT_SECONDS = 0.25  # a round trip on the pod network takes well under a millisecond
KEY_PREFIX = "flotilla:ratelimit:"

# Both scripts: a bucket's level refilled to the server's now under the current capacity and rate. A
# missing key is a full bucket. Nothing is written for a refused request.
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, capacity, rate)
  local stored = redis.call('HMGET', key, 'level', 'updated')
  local value, updated = tonumber(stored[1]), tonumber(stored[2])
  if value == nil or updated == nil then return capacity end
  if now > updated then value = value + (now - updated) * rate end
  return math.min(capacity, value)
end
local function store(key, value, capacity, rate)
  redis.call('HSET', key, 'level', tostring(value), 'updated', tostring(now))
  redis.call('EXPIRE', key, math.max(1, math.ceil((capacity - value) / rate) + 1))
end
"""
# KEYS: requests, tokens. ARGV: requests' capacity and rate, tokens' capacity and rate (rate 0: no limit).
# Returns {0, 0} when admitted, else {1 (requests) or 2 (tokens), whole seconds to wait}.
ADMIT_SCRIPT = (
    _BUCKET
    + """
local rc, rr, tc, tr = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local requests, tokens, wait_requests, wait_tokens = 0, 0, 0, 0
if rr > 0 then
  requests = level(KEYS[1], rc, rr)
  if requests < 1 then wait_requests = math.max(1, math.ceil((1 - requests) / rr)) end
end
if tr > 0 then
  tokens = level(KEYS[2], tc, tr)
  if tokens <= 0 then wait_tokens = math.max(1, math.floor((0 - tokens) / tr) + 1) end
end
if wait_requests > 0 or wait_tokens > 0 then
  if wait_requests >= wait_tokens then return {1, wait_requests} end
  return {2, wait_tokens}
end
if rr > 0 then store(KEYS[1], requests - 1, rc, rr) end
return {0, 0}
"""
)
# KEYS: tokens. ARGV: capacity, rate, tokens to take (below zero if need be).
CHARGE_SCRIPT = (
    _BUCKET
    + """
local capacity, rate, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
store(KEYS[1], level(KEYS[1], capacity, rate) - n, capacity, rate)
return 0
"""
)


def bucket_keys(tenant: str) -> tuple[str, str]:
    """The tenant's request and token buckets (the `{tenant}` hash tag keeps both in one slot)."""
    return f"{KEY_PREFIX}{{{tenant}}}:requests", f"{KEY_PREFIX}{{{tenant}}}:tokens"


def _shape(limits: RateLimits) -> tuple[float, float, float, float]:
    """(requests' capacity, rate, tokens' capacity, rate), rate 0 for a limit not set: core's shapes."""
    return (*(request_shape(limits) or (0.0, 0.0)), *(token_shape(limits) or (0.0, 0.0)))


class LocalLimits:
    """This replica's buckets: limits per gateway replica."""

    def __init__(self) -> None:
        self.buckets = RateLimiter()

    async def admit(self, tenant: str, limits: RateLimits) -> Admitted | Limited:
        return self.buckets.admit(tenant, limits, time.monotonic())

    def charge(self, tenant: str, limits: RateLimits, tokens: int) -> None:
        self.buckets.charge_tokens(tenant, tokens, time.monotonic())

    def forget(self, tenant: str) -> None:
        self.buckets.forget(tenant)

    async def close(self) -> None:
        pass


class SharedLimits(LocalLimits):
    """Every replica's buckets in one Redis (`url`: redis://host:port/db); this replica's own (the parent's)
    while Redis fails. `on_error` is called once per failed operation (the gateway counts them)."""

    def __init__(self, url: str, on_error: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        from redis.asyncio import Redis  # only a gateway given a store needs the client

        self.url, self.on_error = url, on_error
        self.redis = Redis.from_url(
            url, socket_timeout=STORE_TIMEOUT_SECONDS, socket_connect_timeout=STORE_TIMEOUT_SECONDS
        )
        self._admit = self.redis.register_script(ADMIT_SCRIPT)
        self._charge = self.redis.register_script(CHARGE_SCRIPT)
        self.local_until = 0.0  # monotonic time until which this replica decides alone
        self.charges: set[asyncio.Task] = set()

    def _failed(self, what: str, exc: Exception) -> None:
        self.on_error()
        if time.monotonic() >= self.local_until:
            log.warning("rate-limit store %s: %s failed (%s); per-replica limits for %gs", self.url, what,
                        exc, RETRY_SECONDS)  # fmt: skip
        self.local_until = time.monotonic() + RETRY_SECONDS

    def _local(self) -> bool:
        return time.monotonic() < self.local_until

    async def admit(self, tenant: str, limits: RateLimits) -> Admitted | Limited:
        if not limits.kinds():
            return ADMITTED
        if not self._local():
            try:
                answer: Any = await self._admit(keys=list(bucket_keys(tenant)), args=list(_shape(limits)))
                kind, seconds = answer
            except Exception as exc:  # any failure of the store: decide here, counted
                self._failed("admit", exc)
            else:
                if int(kind) == 0:
                    return ADMITTED
                return refusal("requests" if int(kind) == 1 else "tokens", int(seconds), tenant, limits)
        return await super().admit(tenant, limits)

    def charge(self, tenant: str, limits: RateLimits, tokens: int) -> None:
        """Non-blocking: the charge is sent in the background (a completion's end must not wait on it)."""
        if limits.tokens_per_minute is None or tokens <= 0:
            return
        if self._local():
            super().charge(tenant, limits, tokens)
            return
        task = asyncio.ensure_future(self._send_charge(tenant, limits, tokens))
        self.charges.add(task)
        task.add_done_callback(self.charges.discard)

    async def _send_charge(self, tenant: str, limits: RateLimits, tokens: int) -> None:
        capacity, rate = _shape(limits)[2:]
        try:
            await self._charge(keys=[bucket_keys(tenant)[1]], args=[capacity, rate, tokens])
        except Exception as exc:
            self._failed("charge", exc)
            super().charge(tenant, limits, tokens)

    async def close(self) -> None:
        if self.charges:
            await asyncio.wait(set(self.charges), timeout=2 * STORE_TIMEOUT_SECONDS)
        with contextlib.suppress(Exception):
            await self.redis.aclose()


def tenant_limits(url: str | None, on_error: Callable[[], None]) -> LocalLimits:
    """The buckets a gateway uses: shared in Redis when `url` is set, else its own."""
    return SharedLimits(url, on_error) if url else LocalLimits()
