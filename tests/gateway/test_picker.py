"""The endpoint picker: prefix-aware, least-load and round-robin routing."""

from __future__ import annotations

import pytest

from flotilla.gateway.core.picker import DEFAULT_WEIGHTS, REASONS, EndpointLoad, Routing, pick
from flotilla.gateway.core.services import Endpoint

A, B, C = (Endpoint(f"http://10.0.0.{i}:8000", f"p{i}", True, False) for i in (1, 2, 3))
ALL = [C, A, B]  # unsorted on purpose: the picker must not depend on the caller's order


def urls(*pairs: tuple[Endpoint, EndpointLoad]) -> dict[str, EndpointLoad]:
    return {e.url: load for e, load in pairs}


def test_prefix_prefers_the_replica_holding_the_prompt_prefix() -> None:
    loads = urls((A, EndpointLoad(2, 0, 0.3)), (B, EndpointLoad(1, 0, 0.1)), (C, EndpointLoad(0, 0, 0.0)))
    decision = pick("prefix", ALL, loads, {B.url: 8, A.url: 2}, total_blocks=10, rr_counter=0)
    assert decision is not None
    assert (decision.endpoint, decision.reason, decision.hit_blocks) == (B, "prefix_hit", 8)


def test_prefix_hit_beats_a_busier_spread_when_it_covers_the_prompt() -> None:
    # A is busier (within the gap) and has a fuller cache, but holds the whole prompt.
    loads = urls((A, EndpointLoad(DEFAULT_WEIGHTS.max_queue_gap, 0, 0.9)), (B, EndpointLoad(0, 0, 0.0)))
    decision = pick("prefix", [A, B], loads, {A.url: 10}, total_blocks=10, rr_counter=0)
    assert decision is not None and decision.endpoint == A and decision.reason == "prefix_hit"


def test_prefix_falls_back_to_least_load_when_the_holder_is_overloaded() -> None:
    gap = DEFAULT_WEIGHTS.max_queue_gap
    loads = urls((A, EndpointLoad(gap, 1, 0.5)), (B, EndpointLoad(0, 0, 0.2)), (C, EndpointLoad(0, 0, 0.1)))
    decision = pick("prefix", ALL, loads, {A.url: 10}, total_blocks=10, rr_counter=0)
    assert decision is not None
    assert (decision.endpoint, decision.reason, decision.hit_blocks) == (C, "least_load", 0)
    # Exactly at the gap, the holder still counts.
    loads[A.url] = EndpointLoad(gap, 0, 0.5)
    decision = pick("prefix", ALL, loads, {A.url: 10}, total_blocks=10, rr_counter=0)
    assert decision is not None and decision.endpoint == A


def test_prefix_overloaded_holder_leaves_the_next_best_partial_hit() -> None:
    loads = urls((A, EndpointLoad(20, 0, 0.5)), (B, EndpointLoad(1, 0, 0.2)), (C, EndpointLoad(0, 0, 0.1)))
    decision = pick("prefix", ALL, loads, {A.url: 10, B.url: 8}, total_blocks=10, rr_counter=0)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, "prefix_hit")


def test_prefix_without_hits_is_least_load() -> None:
    loads = urls((A, EndpointLoad(3, 0, 0.0)), (B, EndpointLoad(0, 1, 0.0)), (C, EndpointLoad(0, 0, 0.0)))
    decision = pick("prefix", ALL, loads, {}, total_blocks=0, rr_counter=0)
    assert decision is not None and (decision.endpoint, decision.reason) == (C, "least_load")


def test_prefix_ties_spread_by_the_counter() -> None:
    idle = [pick("prefix", ALL, {}, {}, total_blocks=4, rr_counter=i) for i in range(3)]
    assert [d.endpoint for d in idle if d] == [A, B, C]
    hits = {A.url: 4, C.url: 4}
    tied = [pick("prefix", ALL, {}, hits, 4, rr_counter=i) for i in range(4)]
    assert [d.endpoint for d in tied if d] == [A, C, A, C]


def test_least_load_uses_queue_then_kv_usage() -> None:
    loads = urls((A, EndpointLoad(1, 1, 0.1)), (B, EndpointLoad(0, 2, 0.0)), (C, EndpointLoad(2, 0, 0.05)))
    # All queues are 2: the emptiest KV cache wins; prefix hits do not matter.
    decision = pick("least-load", ALL, loads, {A.url: 5}, total_blocks=5, rr_counter=7)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, "least_load")
    loads[A.url] = EndpointLoad(0, 1, 0.9)
    decision = pick("least-load", ALL, loads, {}, total_blocks=0, rr_counter=7)
    assert decision is not None and decision.endpoint == A


def test_round_robin_cycles_in_url_order() -> None:
    picked = [pick("round-robin", ALL, {}, {}, 0, rr_counter=i) for i in range(6)]
    assert [d.endpoint for d in picked if d] == [A, B, C, A, B, C]
    assert {d.reason for d in picked if d} == {"round_robin"}


def test_exclude_skips_the_failed_endpoint() -> None:
    policies: tuple[Routing, ...] = ("prefix", "least-load", "round-robin")
    for policy in policies:
        for i in range(4):
            decision = pick(policy, ALL, {}, {A.url: 3}, 3, rr_counter=i, exclude={A.url})
            assert decision is not None and decision.endpoint != A
    decision = pick("prefix", [A, B], {}, {A.url: 3}, 3, rr_counter=0, exclude=[A.url])
    assert decision is not None and (decision.endpoint, decision.reason) == (B, "only_endpoint")
    assert pick("prefix", [A], {}, {}, 0, rr_counter=0, exclude=[A.url]) is None
    assert pick("round-robin", [], {}, {}, 0, rr_counter=0) is None


def test_only_endpoint_reports_its_hits() -> None:
    decision = pick("prefix", [A], {}, {A.url: 3}, total_blocks=5, rr_counter=0)
    assert decision is not None and (decision.reason, decision.hit_blocks) == ("only_endpoint", 3)


def test_reasons_are_the_fixed_label_set_and_unknown_policy_fails() -> None:
    assert REASONS == ("prefix_hit", "least_load", "round_robin", "only_endpoint")
    with pytest.raises(ValueError, match="unknown routing policy"):
        pick("fastest", ALL, {}, {}, 0, 0)  # type: ignore[arg-type]


def test_a_hit_on_a_small_share_of_the_prompt_is_not_affinity() -> None:
    """A preamble every prompt shares must not send every prompt where the first one went."""
    loads = urls((A, EndpointLoad(1, 0, 0.0)), (B, EndpointLoad(0, 0, 0.0)))
    small = int(DEFAULT_WEIGHTS.min_hit_fraction * 40) - 1  # just under the share that counts, of 40 blocks
    decision = pick("prefix", [A, B], loads, {A.url: small}, total_blocks=40, rr_counter=0)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, "least_load")
    decision = pick("prefix", [A, B], loads, {A.url: 40}, total_blocks=40, rr_counter=0)
    assert decision is not None and (decision.endpoint, decision.reason) == (A, "prefix_hit")
