"""Metering: spans from pods, exactly-once rounds, day buckets, views, cost and token counters."""

from __future__ import annotations

from datetime import UTC, datetime

from flotilla.operator.api.v1alpha1 import MeteringLedger, TokenCount
from flotilla.operator.tenancy.metering import (
    NODE_SILENCE_SECONDS,
    cost,
    count_tokens,
    meter,
    metered_end,
    span_of,
    split_by_day,
    usage_views,
)


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def pod(uid="u1", gpus=2, scheduled="2026-01-01T10:00:00Z", phase="Running", finished=None) -> dict:
    statuses = [{"state": {"terminated": {"finishedAt": finished}}}] if finished else []
    return {
        "metadata": {"uid": uid, "namespace": "ns", "labels": {"flotilla.dev/inferenceservice": "chat"}},
        "spec": {"nodeSelector": {"flotilla.dev/gpu-type": "h100"},
                 "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": phase, "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}],
                   "containerStatuses": statuses},
    }  # fmt: skip


def test_span_from_binding_to_termination_or_removal():
    span = span_of(pod())
    assert (
        span.key == "ns/chat/h100"
        and span.gpus == 2
        and span.start == ts("2026-01-01T10:00:00")
        and span.end is None
    )
    done = span_of(pod(phase="Succeeded", finished="2026-01-01T10:01:00Z"))
    assert done.end == ts("2026-01-01T10:01:00")
    assert span_of(pod(), removed_at=ts("2026-01-01T10:00:30")).end == ts("2026-01-01T10:00:30")
    assert span_of(pod(gpus=0)) is None
    unbound = pod()
    unbound["status"]["conditions"] = []
    assert span_of(unbound) is None


def test_a_raw_gpu_pod_is_charged_under_its_nodes_gpu_type():
    raw = pod()
    raw["spec"] = {"nodeName": "gpu-node-2", "containers": raw["spec"]["containers"]}  # no nodeSelector
    raw["metadata"]["labels"] = {}
    span = span_of(raw, node_gpu_types={"gpu-node-1": "h100", "gpu-node-2": "a100"})
    assert span is not None and span.gpu_type == "a100" and span.key == "ns/-/a100"
    # A node whose type the operator does not know yet: the unknown type, not a guess.
    assert span_of(raw, node_gpu_types={}).gpu_type == "-"


def test_rounds_count_each_second_once_whatever_the_split():
    span = span_of(pod(gpus=2))
    start = span.start
    one = meter(MeteringLedger(), [span], None, start + 100)
    # The same 100 s in rounds that stop and start anywhere (an operator killed between them).
    ledger, since = MeteringLedger(), None
    for until in (start + 7, start + 7.5, start + 40, start + 100):
        ledger, since = meter(ledger, [span], since, until), until
    assert one.total == {"ns/chat/h100": 200.0}
    assert abs(ledger.total["ns/chat/h100"] - 200.0) < 1e-9


def test_ended_pods_and_day_boundaries():
    span = span_of(pod(gpus=1, scheduled="2026-01-01T23:59:00Z"), removed_at=ts("2026-01-02T00:01:00"))
    ledger = meter(MeteringLedger(), [span], ts("2026-01-01T23:00:00"), ts("2026-01-02T01:00:00"))
    assert ledger.daily == {"2026-01-01": {"ns/chat/h100": 60.0}, "2026-01-02": {"ns/chat/h100": 60.0}}
    assert list(split_by_day(ts("2026-01-01T23:00:00"), ts("2026-01-01T23:30:00"))) == [
        ("2026-01-01", 1800.0)
    ]
    views = usage_views(ledger, ts("2026-01-02T12:00:00"))
    assert (
        views.today.total == 60 and views.month.total == 120 and views.total.by_service == {"ns/chat": 120.0}
    )
    assert views.total.by_namespace == {"ns": 120.0} and views.total.by_gpu_type == {"h100": 120.0}


def test_old_daily_buckets_are_pruned():
    old = MeteringLedger(daily={"2025-01-01": {"ns/chat/h100": 5.0}}, total={"ns/chat/h100": 5.0})
    ledger = meter(old, [], ts("2026-01-01T00:00:00"), ts("2026-01-01T00:00:10"))
    assert ledger.daily == {} and ledger.total == {"ns/chat/h100": 5.0}


def test_cost_is_gpu_hours_times_price():
    assert cost({"h100": 7200.0, "a100": 3600.0}, {"h100": 2.5}) == 5.0


def test_token_counters_count_deltas_and_restarts():
    added, counters = count_tokens({}, {"p1": TokenCount(input=10, output=5)})
    assert added == TokenCount(input=10, output=5)
    added, counters = count_tokens(counters, {"p1": TokenCount(input=15, output=9)})
    assert added == TokenCount(input=5, output=4)
    added, _ = count_tokens(counters, {"p1": TokenCount(input=3, output=1)})  # the engine restarted
    assert added == TokenCount(input=3, output=1)


def test_a_deleted_pod_ends_when_its_node_let_it_go_or_at_its_deadline():
    """The durable facts a restarted operator reads back from a pod its finalizer kept in the API."""
    stopped = pod(finished="2026-01-01T10:05:07Z")
    stopped["metadata"].update(deletionTimestamp="2026-01-01T10:05:00Z", deletionGracePeriodSeconds=0)
    assert span_of(stopped).end == ts("2026-01-01T10:05:07")  # the container's own end
    simulated = pod()
    simulated["metadata"].update(deletionTimestamp="2026-01-01T10:05:00Z", deletionGracePeriodSeconds=0)
    assert span_of(simulated).end == ts("2026-01-01T10:05:00")  # nothing ran past the deletion
    silent = pod()
    silent["metadata"].update(deletionTimestamp="2026-01-01T10:05:30Z", deletionGracePeriodSeconds=30)
    assert span_of(silent, now=ts("2026-01-01T10:05:40")).end is None  # the node may still be stopping it
    late = ts("2026-01-01T10:05:30") + NODE_SILENCE_SECONDS
    assert span_of(silent, now=late).end == ts("2026-01-01T10:05:30")  # its deadline: the latest possible
    # Its finalizer may go only once a round has counted it to its end.
    assert not metered_end(stopped, ts("2026-01-01T10:05:06"))
    assert metered_end(stopped, ts("2026-01-01T10:05:07"))
    assert not metered_end(pod(), ts("2026-01-02T00:00:00"))  # still running


def test_adapter_counters_count_per_adapter_deltas_restarts_and_reloads():
    from flotilla.operator.tenancy.metering import count_adapter_tokens

    ns = {"p1": "a1", "p2": "a1"}
    t = TokenCount
    added, counters = count_adapter_tokens(
        {}, {"p1": {"fr": t(input=10, output=5)}, "p2": {"fr": t(input=1)}}, ns
    )
    assert added == {"a1/fr": t(input=11, output=5)}  # both replicas of the service, summed
    added, counters = count_adapter_tokens(
        counters, {"p1": {"fr": t(input=15, output=9), "de": t(output=2)}}, ns
    )
    assert added == {"a1/fr": t(input=5, output=4), "a1/de": t(output=2)}
    assert counters["p2"] == {"fr": t(input=1)}  # not read this time: kept
    added, counters = count_adapter_tokens(counters, {"p1": {"fr": t(input=3, output=1)}}, ns)  # restarted
    assert added == {"a1/fr": t(input=3, output=1)}
    assert "de" not in counters["p1"]  # unloaded (its series went): a reload counts from zero
    added, _ = count_adapter_tokens(counters, {"p1": {"fr": t(input=3, output=1), "de": t(output=7)}}, ns)
    assert added == {"a1/fr": t(), "a1/de": t(output=7)}


def test_adapters_on_a_shared_base_count_for_their_own_namespace_and_tenant_only():
    """On a shared base the engine serves an adapter as `namespace/name` (desired.lora_adapter.served_name):
    its tokens are that namespace's adapter's, whatever namespace the pod is in, and a tenant reading the
    shared engines keeps the counters of its own namespaces' adapters only."""
    from flotilla.operator.tenancy.metering import adapter_key, count_adapter_tokens, shared_adapter_counters

    t = TokenCount
    assert adapter_key("shared", "a1/fr") == "a1/fr" and adapter_key("a1", "fr") == "a1/fr"
    read = {"s1": {"a1/fr": t(input=7, output=3), "b1/fr": t(input=50), "local": t(input=9)}}
    mine = shared_adapter_counters(read, ["a1", "a2"])
    assert mine == {"s1": {"a1/fr": t(input=7, output=3)}}  # b1's adapter and the shared ns's own: not ours
    added, counters = count_adapter_tokens({}, mine, {"s1": "shared"})
    assert added == {"a1/fr": t(input=7, output=3)}
    added, _ = count_adapter_tokens(counters, {"s1": {"a1/fr": t(input=8, output=5)}}, {"s1": "shared"})
    assert added == {"a1/fr": t(input=1, output=2)}


def test_adapter_usage_keeps_existing_adapters_only_and_prices_them_at_the_tenants_rate():
    from flotilla.operator.api.v1alpha1 import AdapterUsage
    from flotilla.operator.tenancy.metering import adapter_usage

    before = {
        "a1/fr": AdapterUsage(input=400_000, output=100_000, cost=1.0),
        "a1/gone": AdapterUsage(input=9),
    }
    added = {"a1/fr": TokenCount(input=400_000, output=100_000), "a1/orphan": TokenCount(input=5)}
    out = adapter_usage(before, added, ["a1/fr", "a1/new"], 2.0)
    assert out == {
        "a1/fr": AdapterUsage(input=800_000, output=200_000, cost=2.0),
        "a1/new": AdapterUsage(),
    }
    assert adapter_usage(out, {}, ["a1/fr"], None)["a1/fr"].cost == 0.0  # no tokens priced yet
