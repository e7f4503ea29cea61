"""Service received per tenant: the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024).

Each tenant's counter grows by the weighted tokens it is served (prompt tokens x w_in when a request is
first admitted, each generated token x w_out), divided by the tenant's weight. The `fair` policy admits
from the backlogged tenant with the lowest counter. A tenant that comes back after an idle spell is lifted
to the lowest counter of the tenants still active (or to where the last active tenant stood when the
engine went idle), so idle time is never banked as credit. Kept under every policy, so that the metrics
show each tenant's service whatever the order. Plain Python, no torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FairShareConfig:
    input_weight: float = 1.0  # w_in: the cost of a prompt token
    output_weight: float = 2.0  # w_out: the cost of a generated token (the paper's default ratio)
    tenant_weights: dict[str, float] = field(default_factory=dict)  # absent tenants weigh 1

    def __post_init__(self) -> None:
        for name, value in (("input_weight", self.input_weight), ("output_weight", self.output_weight)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for tenant, weight in self.tenant_weights.items():
            if not weight > 0:
                raise ValueError(f"tenant weight of {tenant!r} must be positive, got {weight}")

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


@dataclass
class TenantService:
    """What one tenant has been served, for the metrics."""

    counter: float = 0.0  # weighted service / weight (the virtual token counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    outstanding: int = 0  # requests waiting or running


class FairShareLedger:
    def __init__(self, config: FairShareConfig | None = None) -> None:
        self.config = config or FairShareConfig()
        self.tenants: dict[str, TenantService] = defaultdict(TenantService)
        self._idle_floor = 0.0  # where the last active tenant stood when the engine went idle
        self.num_active = 0  # tenants with a request waiting or running

    def counter(self, tenant: str) -> float:
        return self.tenants[tenant].counter

    def active(self) -> list[str]:
        return [name for name, service in self.tenants.items() if service.outstanding > 0]

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` joined the queue."""
        service = self.tenants[tenant]
        if service.outstanding == 0:
            others = [self.tenants[name].counter for name in self.active()]
            floor = min(others) if others else self._idle_floor
            service.counter = max(service.counter, floor)
            self.num_active += 1
        service.outstanding += 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` finished or was aborted."""
        service = self.tenants[tenant]
        service.outstanding -= 1
        if service.outstanding == 0:
            self.num_active -= 1
            if self.num_active == 0:
                self._idle_floor = service.counter

    def charge_prompt(self, tenant: str, num_tokens: int) -> None:
        service = self.tenants[tenant]
        service.prompt_tokens += num_tokens
        service.counter += num_tokens * self.config.input_weight / self.config.weight(tenant)

    def charge_generated(self, tenant: str, num_tokens: int = 1) -> None:
        service = self.tenants[tenant]
        service.generation_tokens += num_tokens
        service.counter += num_tokens * self.config.output_weight / self.config.weight(tenant)

    def bound(self, max_prompt_tokens: int, max_batch_tokens: int) -> float:
        """The paper's bound on how far two continuously backlogged tenants' weighted service can drift
        apart over any interval: 2 x max(w_in x the longest prompt, w_out x the most tokens in a batch)."""
        return 2 * max(
            self.config.input_weight * max_prompt_tokens, self.config.output_weight * max_batch_tokens
        )
