"""One gateway process's settings (the flags of `flotilla gateway run` fill them)."""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.gateway.core.picker import Routing

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Behind Envoy, a held request asks Envoy to wait for the picker's answer this long past the hold timeout
# (the picker's override_message_timeout; Envoy's max_message_timeout is the same sum).
HOLD_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class GatewaySettings:
    routing: Routing = "prefix"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 before anything else
    # How long a request waits for a replica of a service at zero (or whose replicas all restart): a cold
    # start pulls and loads a model, minutes for a large one.
    hold_timeout: float = 300.0
    max_held: int = 64  # per service; past it, 429
    heartbeat_seconds: float = 5.0  # SSE comments to held streaming clients, so proxies keep the stream
    # The installation's master token: the gateway's credential on the engines (contract.gateway_token)
    # and the picker's (contract.picker_token) derive from it. Without it the gateway names no tenant to
    # the engines, which then count requests under their own tenant, and the picker answers anyone.
    engine_token_master: str | None = None
    # Redis (redis://host:port/db) holding every gateway replica's rate-limit buckets, so that a tenant's
    # limits are global; unset: each replica counts alone (tenant_limits.py).
    rate_limit_store: str | None = None
    require_keys: bool = True  # False only for a static fleet (benchmarks): no tenants, no keys
    upstream_timeout: float = 600.0  # seconds between two upstream bytes before the gateway gives up
