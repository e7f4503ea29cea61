"""Scale to zero and back, for a service with minReplicas 0: when it counts as idle, and when a demand
brings it back. Pure; the rule (rule.py) acts on what these say.

- Idle: every ready pod answered, none has a request running or waiting, and no pod's token counters moved
  since the last decision. The idle clock restarts on any activity and on any rise of the replicas (a scale
  from zero gets a whole idle period to load its model and serve), and starts afresh with the operator. A
  round in which a ready pod did not answer says nothing: the clock neither restarts nor may the service go
  to zero on it (a failed scrape never shrinks a service).
- Demand: the gateway stamps flotilla.contract.ANNOTATION_DEMAND with the RFC 3339 time it held a request
  for the service. A stamp within the idle period (either side of now: clocks differ) is fresh: it scales a
  service at zero to one replica and keeps one from going to zero. An older one is stale and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flotilla.timestamps import parse_time

DEMAND = "Demand"  # the reason of a scale from zero
IDLE = "Idle"  # the reason of a scale to zero
AT_ZERO = "ScaledToZero"  # the reason while a service rests at zero


def demand_time(value: str | None) -> float | None:
    """The demand annotation's time in seconds since the epoch; None when absent or not RFC 3339."""
    if not value:
        return None
    try:
        return parse_time(value).timestamp()
    except ValueError:
        return None


def fresh_demand(demand_at: float | None, now: float, idle_seconds: float) -> bool:
    """Whether a demand at `demand_at` (epoch seconds) still counts at `now`."""
    return demand_at is not None and abs(now - demand_at) < idle_seconds


@dataclass(frozen=True)
class Activity:
    """What one decision saw of a service's use, over its ready pods."""

    known: bool  # every ready pod answered
    busy: bool  # some ready pod has a request running or waiting
    tokens: Mapping[str, float] = field(default_factory=dict)  # pod -> lifetime prompt + generation tokens


def activity(
    ready: list[str],
    waiting: Mapping[str, float],
    running: Mapping[str, float],
    tokens: Mapping[str, float],
    failed: bool,
) -> Activity:
    """`ready` are the ready pods' names; the mappings hold what the pods that answered reported."""
    known = not failed and all(name in waiting for name in ready)
    busy = any(waiting.get(n, 0.0) > 0 or running.get(n, 0.0) > 0 for n in ready)
    return Activity(known=known, busy=busy, tokens={n: tokens[n] for n in ready if n in tokens})


@dataclass
class IdleClock:
    """How long a service has been idle, between decisions (monotonic seconds)."""

    since: float | None = None
    replicas: int = 0  # the replicas at the last observation
    tokens: dict[str, float] = field(default_factory=dict)  # the pods' counters at the last observation

    def observe(self, now: float, current: int, seen: Activity) -> float | None:
        """Seconds idle as of `now`; None when this round cannot tell."""
        served = any(value != self.tokens.get(pod, 0.0) for pod, value in seen.tokens.items())
        self.tokens = {**self.tokens, **seen.tokens}
        rose, self.replicas = current > self.replicas, current
        if seen.busy or served or rose or self.since is None:
            self.since = now
        if not seen.known:
            return None
        return now - self.since

    def forget(self, pods: set[str]) -> None:
        """Drop the counters of pods that are gone."""
        self.tokens = {pod: value for pod, value in self.tokens.items() if pod in pods}
