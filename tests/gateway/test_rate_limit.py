"""Per-tenant rate limits: request and token buckets, Retry-After, post-paid tokens. The clock is passed in."""

from __future__ import annotations

from flotilla.gateway.core.rate_limit import (
    ADMITTED,
    UNLIMITED,
    Limited,
    RateLimiter,
    RateLimits,
    rate_limits_of,
)


def test_rate_limits_of_a_tenant() -> None:
    tenant = {"spec": {"rateLimits": {"requestsPerSecond": 2.5, "tokensPerMinute": 6000}}}
    assert rate_limits_of(tenant) == RateLimits(2.5, 6000)
    assert rate_limits_of({"spec": {"rateLimits": {"requestsPerSecond": 5}}}) == RateLimits(5.0, None)
    assert rate_limits_of({"spec": {}}) == UNLIMITED
    assert rate_limits_of(None) == UNLIMITED
    garbage = {"spec": {"rateLimits": {"requestsPerSecond": "fast", "tokensPerMinute": -1}}}
    assert rate_limits_of(garbage) == UNLIMITED
    assert rate_limits_of({"spec": {"rateLimits": {"requestsPerSecond": True}}}) == UNLIMITED


def test_unlimited_always_admits() -> None:
    limiter = RateLimiter()
    assert all(limiter.admit("a", UNLIMITED, now=0.0) is ADMITTED for _ in range(1000))
    limiter.charge_tokens("a", 10**9, now=0.0)  # no token limit: nothing to charge
    assert limiter.admit("a", UNLIMITED, now=0.0) is ADMITTED


def test_requests_burst_one_second_then_retry_after() -> None:
    limiter, limits = RateLimiter(), RateLimits(requests_per_second=5)
    assert [limiter.admit("a", limits, now=100.0) for _ in range(5)] == [ADMITTED] * 5
    refused = limiter.admit("a", limits, now=100.0)
    assert refused == Limited("requests", 1, "tenant a exceeded its rate limit of 5 requests per second")
    assert limiter.admit("a", limits, now=100.2) is ADMITTED  # one request refilled in 1/5 s
    assert isinstance(limiter.admit("a", limits, now=100.2), Limited)
    # Another tenant has its own bucket.
    assert limiter.admit("b", limits, now=100.2) is ADMITTED


def test_slow_request_rate_retry_after_rounds_up() -> None:
    limiter, limits = RateLimiter(), RateLimits(requests_per_second=0.25)  # one request per 4 s
    assert limiter.admit("a", limits, now=0.0) is ADMITTED  # a burst of at least one request
    refused = limiter.admit("a", limits, now=1.5)
    assert isinstance(refused, Limited) and refused.retry_after_seconds == 3  # 2.5 s left: 3
    assert "0.25 requests per second" in refused.message
    assert isinstance(limiter.admit("a", limits, now=3.9), Limited)  # refused: nothing taken
    assert limiter.admit("a", limits, now=4.0) is ADMITTED


def test_token_bucket_goes_negative_then_recovers() -> None:
    limiter, limits = RateLimiter(), RateLimits(tokens_per_minute=600)  # 10 tokens a second
    assert limiter.admit("a", limits, now=0.0) is ADMITTED
    limiter.charge_tokens("a", 500, now=0.0)  # the prompt
    assert limiter.admit("a", limits, now=0.0) is ADMITTED  # 100 left: still above zero
    limiter.charge_tokens("a", 300, now=0.0)  # the first request's completion
    refused = limiter.admit("a", limits, now=0.0)  # -200: 20 s to get above zero, so 21
    assert refused == Limited("tokens", 21, "tenant a exceeded its rate limit of 600 tokens per minute")
    assert isinstance(limiter.admit("a", limits, now=20.0), Limited)  # exactly zero is not above it
    assert limiter.admit("a", limits, now=20.1) is ADMITTED


def test_token_bucket_refills_no_further_than_a_minute() -> None:
    limiter, limits = RateLimiter(), RateLimits(tokens_per_minute=60)
    assert limiter.admit("a", limits, now=0.0) is ADMITTED
    limiter.charge_tokens("a", 60, now=3600.0)  # an hour idle refills only to 60, then all is spent
    refused = limiter.admit("a", limits, now=3600.0)
    assert isinstance(refused, Limited) and refused.retry_after_seconds == 1


def test_refused_request_takes_nothing_and_longer_limit_is_reported() -> None:
    limiter, limits = RateLimiter(), RateLimits(requests_per_second=1, tokens_per_minute=60)
    assert limiter.admit("a", limits, now=0.0) is ADMITTED
    limiter.charge_tokens("a", 120, now=0.0)  # -60: 61 s for tokens, 1 s for requests
    refused = limiter.admit("a", limits, now=0.0)
    assert isinstance(refused, Limited) and (refused.limit, refused.retry_after_seconds) == ("tokens", 61)
    # The refusal took no request: once tokens are back, the request bucket is full again.
    assert limiter.admit("a", limits, now=61.0) is ADMITTED


def test_edited_limits_take_effect_on_the_next_admit() -> None:
    limiter = RateLimiter()
    assert all(limiter.admit("a", RateLimits(requests_per_second=10), now=0.0) is ADMITTED for _ in range(3))
    # Cut to 1/s: the bucket (7 left) is cut to the new capacity of 1.
    assert limiter.admit("a", RateLimits(requests_per_second=1), now=0.0) is ADMITTED
    assert isinstance(limiter.admit("a", RateLimits(requests_per_second=1), now=0.0), Limited)
    # The limit removed: unlimited at once; set again: a fresh, full bucket.
    assert limiter.admit("a", UNLIMITED, now=0.0) is ADMITTED
    assert limiter.admit("a", RateLimits(requests_per_second=1), now=0.0) is ADMITTED


def test_forget_drops_a_tenants_buckets() -> None:
    limiter, limits = RateLimiter(), RateLimits(requests_per_second=1)
    assert limiter.admit("a", limits, now=0.0) is ADMITTED
    assert isinstance(limiter.admit("a", limits, now=0.0), Limited)
    limiter.forget("a")
    assert limiter.admit("a", limits, now=0.0) is ADMITTED
