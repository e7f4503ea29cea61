"""Which replica a request goes to: the gateway's endpoint picker.

Like the Gateway API Inference Extension's endpoint picker and llm-d's scheduler: filter out replicas that
must not get the request, score the rest with weighted scorers, take the best. Pure: the caller passes what
it knows (its own in-flight counts, each engine's last scraped queue and KV usage, the prefix table's
guesses, a round-robin counter), so every decision is reproducible in a test.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from flotilla.gateway.core.services import Endpoint

Routing = Literal["prefix", "least-load", "round-robin"]
ROUTING_POLICIES: tuple[Routing, ...] = ("prefix", "least-load", "round-robin")

# Why an endpoint was picked: a fixed set, the label values of GATEWAY_ROUTING_DECISIONS.
Reason = Literal["prefix_hit", "least_load", "round_robin", "only_endpoint"]
REASONS: tuple[Reason, ...] = ("prefix_hit", "least_load", "round_robin", "only_endpoint")

_EPSILON = 1e-9  # scores this close are equal (float sums of the same terms in another order)


@dataclass(frozen=True)
class EndpointLoad:
    """`in_flight`: requests the gateway has sent and not finished; `waiting`, `kv_usage`: the engine's
    NUM_REQUESTS_WAITING and KV_CACHE_USAGE_RATIO when last scraped (0 before the first scrape). The
    engine's running count is not used: the gateway's in-flight requests are most of it, counted fresher."""

    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @property
    def queue(self) -> int:
        return self.in_flight + self.waiting


@dataclass(frozen=True)
class Weights:
    """The prefix policy's scorers: score = prefix * hit_fraction - load * normalized_load - kv * kv_usage.

    - `prefix` 2: a hit skips the prefill of the blocks it covers, the bulk of a long prompt's time to
      first token. A whole-prompt hit (fraction 1) outweighs being the busiest candidate (normalized load
      1) on a full cache (0.5), so a shared system prompt keeps going where it is cached; a hit of under
      half the prompt does not beat a busier replica's spread by itself.
    - `load` 1: the candidate's queue (in flight + waiting) from the least (0) to the most (1) loaded, so
      that among equal hits the emptiest replica wins.
    - `kv` 0.5: a replica near a full KV cache must preempt or evict to take more, which costs its running
      requests; it matters less than the queue, which the client waits behind.
    - `max_queue_gap` 4: a replica whose queue is more than this many requests longer than the shortest is
      not scored at all. Normalized load says only which is busiest, not by how much: without a gap a hot
      prefix piles every request onto the replica that holds it. Spilling costs one prefill on another
      replica, which then holds the prefix too, and from then on both score the hit. Measured with
      `flotilla gateway bench routing` (3 replicas, 6 concurrent users): a gap of 8 kept a hot replica
      busy while others idled, a gap of 2 spread so early that the p95 gain over round robin fell from
      3.4x to 1.6x.
    - `min_hit_fraction` 0.25: hits on less of the prompt than this are not scored (a shared preamble is
      not affinity; scored, it sent every prompt of a run to one replica, 24/0/0).
    """

    prefix: float = 2.0
    load: float = 1.0
    kv: float = 0.5
    max_queue_gap: int = 4
    min_hit_fraction: float = 0.25


DEFAULT_WEIGHTS = Weights()


@dataclass(frozen=True)
class Decision:
    endpoint: Endpoint
    reason: Reason
    hit_blocks: int = 0  # the leading blocks the endpoint is predicted to hold (GATEWAY_PREDICTED_HIT_TOKENS)


def pick(
    policy: Routing,
    candidates: list[Endpoint],
    loads: Mapping[str, EndpointLoad],
    prefix_hits: Mapping[str, int],
    total_blocks: int,
    rr_counter: int,
    exclude: Collection[str] = (),
    weights: Weights = DEFAULT_WEIGHTS,
) -> Decision | None:
    """The endpoint for one request, or None when no candidate is left.

    `candidates` are routable endpoints (services.routable); `exclude` are urls not to use again (a retry
    after they failed). `prefix_hits` maps url -> leading blocks held (PrefixTable.match), of the prompt's
    `total_blocks` full blocks. `rr_counter` increases per request: it is round robin's position and
    spreads requests over candidates that score the same, so equal replicas share the work.
    """
    pool = sorted((e for e in candidates if e.url not in exclude), key=lambda e: e.url)
    if not pool:
        return None
    hits = {e.url: _hits(prefix_hits, e.url, total_blocks) for e in pool}
    if len(pool) == 1:
        return Decision(pool[0], "only_endpoint", hits[pool[0].url])
    if policy == "round-robin":
        chosen = pool[rr_counter % len(pool)]
        return Decision(chosen, "round_robin", hits[chosen.url])
    load = {e.url: loads.get(e.url, EndpointLoad()) for e in pool}
    if policy == "least-load":
        chosen = _least_load(pool, load, rr_counter)
        return Decision(chosen, "least_load", hits[chosen.url])
    if policy != "prefix":
        raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(ROUTING_POLICIES)}")

    shortest = min(load[e.url].queue for e in pool)
    eligible = [e for e in pool if load[e.url].queue - shortest <= weights.max_queue_gap]
    # A hit on a small share of the prompt (a preamble every prompt shares) is not affinity: scored, it would
    # send every new prompt to wherever the first one went.
    counted = {
        e.url: hits[e.url] if hits[e.url] >= weights.min_hit_fraction * total_blocks else 0 for e in eligible
    }
    if not any(counted.values()):
        chosen = _least_load(eligible, load, rr_counter)
        return Decision(chosen, "least_load", hits[chosen.url])
    queues = [load[e.url].queue for e in eligible]
    low, spread = min(queues), max(queues) - min(queues)

    def score(e: Endpoint) -> float:
        normalized = (load[e.url].queue - low) / spread if spread else 0.0
        fraction = counted[e.url] / total_blocks
        return weights.prefix * fraction - weights.load * normalized - weights.kv * load[e.url].kv_usage

    scores = {e.url: score(e) for e in eligible}
    best = max(scores.values())
    chosen = _spread([e for e in eligible if scores[e.url] >= best - _EPSILON], rr_counter)
    return Decision(chosen, "prefix_hit" if counted[chosen.url] else "least_load", hits[chosen.url])


def _hits(prefix_hits: Mapping[str, int], url: str, total_blocks: int) -> int:
    return max(0, min(prefix_hits.get(url, 0), total_blocks))


def _least_load(pool: list[Endpoint], load: Mapping[str, EndpointLoad], rr_counter: int) -> Endpoint:
    """The shortest queue, then the emptiest KV cache; ties spread by the counter."""
    best = min((load[e.url].queue, load[e.url].kv_usage) for e in pool)
    tied = [e for e in pool if (load[e.url].queue, load[e.url].kv_usage) == best]
    return _spread(tied, rr_counter)


def _spread(tied: list[Endpoint], rr_counter: int) -> Endpoint:
    """One of equally good endpoints (sorted by url), turn by turn, so that ties do not all go to one."""
    return tied[rr_counter % len(tied)]
