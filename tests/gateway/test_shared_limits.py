"""A tenant's rate limits across gateway replicas (issue 51): with `--rate-limit-redis`, every replica takes
from the same buckets in a real Redis (Debian's redis-server, on loopback), so three replicas admit what
one would; with Redis down each replica decides alone (per-replica limits, counted), and once Redis is
back the limits are global again. Each wait is on a condition; the rates are so slow (one request per
1,000 s) that no load on the machine can refill a bucket within a test."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flotilla.contract import GATEWAY_RATE_LIMIT_STORE_ERRORS, counter_total
from flotilla.gateway.core.rate_limit import ADMITTED, Limited, RateLimits
from flotilla.gateway.tenant_limits import RETRY_SECONDS, SharedLimits, bucket_keys

from ..engine.server.conftest import wait_for
from .test_gateway import KEY_B, HandSetFleet, chat_body, engines, make_gateway, post, service, total

__all__ = ["engines", "make_gateway"]  # the fixtures, imported
SLOW = RateLimits(requests_per_second=0.001)  # one request of burst, the next in 1,000 s


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `make install` installs Debian's redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self.answers, timeout=30, what="redis-server to answer")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.proc = None

    def command(self, *words: str) -> bytes:
        """One command, its raw reply (RESP)."""
        wire = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(wire.encode())
            return conn.recv(4096)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer(_free_port())
    server.start()
    yield server
    server.stop()


def run(coroutine):
    return asyncio.run(coroutine)


def test_two_replicas_take_from_one_bucket(redis):
    async def scenario() -> tuple:
        one, two = SharedLimits(redis.url), SharedLimits(redis.url)
        try:
            first = await one.admit("team-a", SLOW)
            second = await two.admit("team-a", SLOW)
            other_tenant = await two.admit("team-b", SLOW)
            return first, second, other_tenant
        finally:
            await one.close()
            await two.close()

    first, second, other_tenant = run(scenario())
    assert first is ADMITTED and other_tenant is ADMITTED
    assert isinstance(second, Limited) and second.limit == "requests"
    assert 900 <= second.retry_after_seconds <= 1000
    assert second.message == "tenant team-a exceeded its rate limit of 0.001 requests per second"


def test_tokens_charged_on_one_replica_refuse_on_another(redis):
    limits = RateLimits(tokens_per_minute=6)  # 6 tokens of burst, 0.1 a second

    async def scenario() -> Limited | object:
        one, two = SharedLimits(redis.url), SharedLimits(redis.url)
        try:
            assert await one.admit("team-a", limits) is ADMITTED
            one.charge("team-a", limits, 10)  # post-paid, below zero: -4
            await asyncio.wait(set(one.charges))
            return await two.admit("team-a", limits)
        finally:
            await one.close()
            await two.close()

    refused = run(scenario())
    assert isinstance(refused, Limited) and refused.limit == "tokens"
    assert 1 <= refused.retry_after_seconds <= 41  # -4 tokens refill at 0.1/s: 41 s at once, less later


def test_without_the_store_a_replica_decides_alone_and_counts_each_failure():
    errors: list[int] = []

    async def scenario() -> list:
        alone = SharedLimits(f"redis://127.0.0.1:{_free_port()}/0", on_error=lambda: errors.append(1))
        try:
            return [await alone.admit("team-a", SLOW) for _ in range(3)]
        finally:
            await alone.close()

    answers = run(scenario())
    # This replica's own bucket: one request, then refusals; the store was asked once, then not for
    # RETRY_SECONDS (a dead store costs one timeout, not one per request).
    assert answers[0] is ADMITTED and all(isinstance(a, Limited) for a in answers[1:])
    assert errors == [1]
    assert RETRY_SECONDS > 0


def test_three_gateway_replicas_admit_what_one_would_and_fail_open_to_their_own_limits(
    engines, make_gateway, redis
):
    def fleet() -> HandSetFleet:
        services = [service("chat", [engines[0].url]), service("chat-b", [engines[0].url], tenant="team-b")]
        return HandSetFleet(services, limits={"team-a": SLOW, "team-b": SLOW})

    replicas = [make_gateway(fleet(), rate_limit_store=redis.url) for _ in range(3)]
    codes = [post(replica, chat_body(f"burst {i}")).status_code for i in range(2) for replica in replicas]
    assert sorted(codes) == [200] + [429] * 5  # per-replica limits would have admitted 3
    assert redis.command("EXISTS", bucket_keys("team-a")[0]) == b":1\r\n"

    # Redis down: each replica decides with its own buckets (team-b's first request passes on each one),
    # and counts the store's failure.
    redis.stop()
    down = [post(replica, chat_body("redis is down"), key=KEY_B).status_code for replica in replicas]
    assert down == [200, 200, 200]
    assert all(total(r.url, counter_total(GATEWAY_RATE_LIMIT_STORE_ERRORS)) >= 1 for r in replicas)

    # Redis back (empty: a restart keeps no buckets). Once each replica's retry interval is over, they
    # share one bucket again: team-a's local buckets are still full (Redis decided before), so a second
    # admission anywhere would show a replica deciding alone.
    redis.start()
    stores = [replica.gateway.door.limits for replica in replicas]
    assert all(isinstance(store, SharedLimits) for store in stores)
    wait_for(lambda: all(not store._local() for store in stores), timeout=60,  # type: ignore[attr-defined]
             what="every replica's retry interval to end")  # fmt: skip
    again = [post(replica, chat_body("redis is back")).status_code for replica in replicas]
    assert again == [200, 429, 429]


def test_the_flag_names_the_store_and_without_it_each_replica_counts_alone():
    from flotilla.cli import build_parser
    from flotilla.gateway.cmd import _settings
    from flotilla.gateway.tenant_limits import LocalLimits, tenant_limits

    args = build_parser().parse_args(["gateway", "run", "--rate-limit-redis", "redis://10.0.0.3:6379/1"])
    assert _settings(args).rate_limit_store == "redis://10.0.0.3:6379/1"
    assert _settings(build_parser().parse_args(["gateway", "run"])).rate_limit_store is None
    assert type(tenant_limits(None, lambda: None)) is LocalLimits
