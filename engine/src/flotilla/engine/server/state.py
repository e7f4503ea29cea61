"""What the server knows at run time: its settings, what serves once the model has loaded, and whether it
drains.

Apart from app.py so the routers can name it without importing the app that includes them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.contract import ENV_TENANT
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.server.metrics import DEFAULT_MAX_TENANT_LABELS, EngineMetrics
from flotilla.engine.server.serving_chat import ServingChat
from flotilla.engine.server.serving_completion import ServingCompletion

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = 256  # requests accepted but not running; None: unbounded
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The operator's credential, which adapter loads and unloads must carry; None: --api-key alone.
    internal_token: str | None = None
    # The SHA-256 of the gateway's credential, which a request must carry to name its tenant; None: no
    # request may.
    gateway_token_sha256: str | None = None
    # Who a request that names no tenant is served for: the Tenant owning the pod's namespace.
    tenant: str = field(default_factory=lambda: os.environ.get(ENV_TENANT, ""))
    # The most request tenants the per-tenant metrics name; later ones are summed under one (metrics.py).
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS

    def __post_init__(self) -> None:
        if self.max_tenant_labels < 1:
            raise ValueError(f"max_tenant_labels must be 1 or more, got {self.max_tenant_labels}")


@dataclass(frozen=True)
class Serving:
    """What serves once the model has loaded: the engine (routes read its tokenizer and `resolved`
    values, nothing deeper) and one serving object per generation endpoint."""

    engine: AsyncEngine
    completion: ServingCompletion
    chat: ServingChat

    @classmethod
    def over(cls, engine: AsyncEngine, metrics: EngineMetrics, model_name: str) -> Serving:
        return cls(
            engine,
            ServingCompletion(engine, metrics, model_name),
            ServingChat(engine, metrics, model_name),
        )


@dataclass
class ServerState:
    settings: ServerSettings
    metrics: EngineMetrics | None = None
    serving: Serving | None = None
    load_error: BaseException | None = None
    draining: bool = False
    in_flight: int = 0  # engine requests accepted and not yet answered
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self) -> AsyncEngine | None:
        return self.serving.engine if self.serving is not None else None

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.load_error is not None:
            return 503, {"status": "failed", "error": f"loading the model failed: {self.load_error}"}
        if self.engine is None:
            return 503, {"status": "loading"}
        if self.engine.error is not None:
            return 503, {"status": "dead", "error": f"the engine loop stopped: {self.engine.error!r}"}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok"}
