"""GPU metering: pods' GPU-holding spans -> GPU-seconds in the Tenant's ledger. Pure.

A pod holds `gpus` from binding (its PodScheduled condition turning True) until it ends: its containers
terminated (Succeeded/Failed: the last finishedAt), or it was deleted (the last finishedAt if the node
reported one; else, once the node has let it go, its deletionTimestamp; else the moment the operator saw
it removed from the API).

Durable facts, not the operator's memory: every engine pod carries METERING_FINALIZER, which the operator
removes only after a round has written the pod's end into the Tenant's ledger. A pod deleted while no
operator runs stays in the API (Terminating, its processes stopped, its end recorded by the node) until
the next operator meters it. A node that never confirms a deleted pod's end is given
NODE_SILENCE_SECONDS past the pod's deletion deadline; then the deadline is taken as its end (the latest
a node may keep it running) and the pod is let go.

Exactly once: each metering round covers the interval (lastMeteredTime, now] and writes the new totals
and the new lastMeteredTime in ONE status update, conditional on the Tenant's resourceVersion. A round
that fails or conflicts writes nothing, and the next round covers the whole interval again; a restarted
operator carries on from the lastMeteredTime it reads back. No interval is counted twice or skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from flotilla import timestamps
from flotilla.operator.api.v1alpha1 import (
    AdapterUsage,
    GPUSeconds,
    MeteringLedger,
    TenantUsage,
    TokenCount,
)
from flotilla.operator.naming import GPU_RESOURCE, GPU_TYPE_LABEL, SERVICE_LABEL

NODE_SILENCE_SECONDS = 60.0
DAILY_RETENTION_DAYS = 62  # two months of daily buckets back `flotilla usage --since/--until`
UNKNOWN = "-"  # the service or GPU type of a pod that names none


@dataclass(frozen=True)
class Span:
    uid: str
    namespace: str
    service: str
    gpu_type: str
    gpus: int
    start: float  # epoch seconds
    end: float | None  # None: still holding

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.service}/{self.gpu_type}"


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return timestamps.parse_time(value).timestamp()


def pod_gpus(pod: Mapping) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(
            GPU_RESOURCE
        )
        total += int(value or 0)
    return total


def span_of(
    pod: Mapping,
    *,
    removed_at: float | None = None,
    node_gpu_types: Mapping[str, str] | None = None,
    now: float | None = None,
) -> Span | None:
    """The pod's GPU span, or None when it holds no GPUs or was never bound. `removed_at`: when the pod
    was seen deleted from the API (a terminating pod holds its GPUs until its containers stop).

    Its GPU type is the one its nodeSelector asks for (Flotilla's engine pods), else its node's
    (`node_gpu_types`: node name -> GPU type): a GPU pod someone else made is charged for the GPUs it
    actually got, never under an unknown type."""
    gpus = pod_gpus(pod)
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    scheduled = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "True"
        ),
        None,
    )
    start = parse_time((scheduled or {}).get("lastTransitionTime"))
    if gpus == 0 or start is None:
        return None
    finished = [
        parse_time(((s.get("state") or {}).get("terminated") or {}).get("finishedAt"))
        for s in status.get("containerStatuses") or []
    ]
    finished = [f for f in finished if f is not None]
    end = None
    deleted = parse_time(meta.get("deletionTimestamp"))
    if status.get("phase") in ("Succeeded", "Failed") and finished:
        end = max(finished)
    elif removed_at is not None:
        end = max(finished) if finished else removed_at
    elif deleted is not None and meta.get("deletionGracePeriodSeconds") == 0:
        end = max(finished) if finished else deleted  # the node stopped it and let it go
    elif deleted is not None and now is not None and now >= deleted + NODE_SILENCE_SECONDS:
        end = deleted  # the node never said: its deadline, the latest it could have run
    if end is not None:
        end = max(end, start)
    return Span(
        uid=meta.get("uid", ""),
        namespace=meta.get("namespace", ""),
        service=(meta.get("labels") or {}).get(SERVICE_LABEL) or UNKNOWN,
        gpu_type=(spec.get("nodeSelector") or {}).get(GPU_TYPE_LABEL)
        or (node_gpu_types or {}).get(spec.get("nodeName") or "")
        or UNKNOWN,
        gpus=gpus,
        start=start,
        end=end,
    )


def _day(epoch: float) -> date:
    return datetime.fromtimestamp(epoch, UTC).date()


def _day_start(day: date) -> float:
    return datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()


def split_by_day(start: float, end: float) -> Iterable[tuple[str, float]]:
    """(UTC date, seconds) pieces of [start, end)."""
    while start < end:
        day = _day(start)
        stop = min(end, _day_start(day + timedelta(days=1)))
        yield day.isoformat(), stop - start
        start = stop


def meter(ledger: MeteringLedger, spans: Iterable[Span], since: float | None, until: float) -> MeteringLedger:
    """The ledger plus every span's GPU-seconds inside (since, until]. `since` None: from each span's
    start (the first round ever counts pods that ran before any operator did)."""
    total = dict(ledger.total)
    daily = {d: dict(v) for d, v in ledger.daily.items()}
    for span in spans:
        lo = span.start if since is None else max(span.start, since)
        hi = until if span.end is None else min(span.end, until)
        for day, seconds in split_by_day(lo, hi):
            total[span.key] = total.get(span.key, 0.0) + seconds * span.gpus
            bucket = daily.setdefault(day, {})
            bucket[span.key] = bucket.get(span.key, 0.0) + seconds * span.gpus
    oldest = (_day(until) - timedelta(days=DAILY_RETENTION_DAYS)).isoformat()
    daily = {d: v for d, v in daily.items() if d >= oldest}
    return ledger.model_copy(update={"total": total, "daily": daily})


def _view(entries: Iterable[tuple[str, float]]) -> GPUSeconds:
    view = GPUSeconds()
    for key, seconds in entries:
        namespace, service, gpu_type = key.split("/", 2)
        view.total += seconds
        for field, name in (
            (view.by_namespace, namespace),
            (view.by_service, f"{namespace}/{service}"),
            (view.by_gpu_type, gpu_type),
        ):
            field[name] = field.get(name, 0.0) + seconds
    return view


def usage_views(ledger: MeteringLedger, now: float) -> TenantUsage:
    today = _day(now)
    month = today.strftime("%Y-%m")
    return TenantUsage(
        today=_view(ledger.daily.get(today.isoformat(), {}).items()),
        month=_view(kv for d, v in ledger.daily.items() if d.startswith(month) for kv in v.items()),
        total=_view(ledger.total.items()),
    )


def cost(gpu_seconds_by_type: Mapping[str, float], price_per_gpu_hour: Mapping[str, float]) -> float:
    """GPU-hours x the current price of each type; types without a price cost nothing."""
    return sum(s / 3600.0 * price_per_gpu_hour.get(t, 0.0) for t, s in gpu_seconds_by_type.items())


def count_tokens(
    previous: Mapping[str, TokenCount], current: Mapping[str, TokenCount]
) -> tuple[TokenCount, dict[str, TokenCount]]:
    """Tokens served since the last read, from each pod's counters (keyed by pod uid). A pod first seen
    counts from zero; a counter that went down restarted (the engine process restarted) and counts from
    zero again. Pods not read this time keep their last counters until they are gone."""
    added_in = added_out = 0
    for uid, now in current.items():
        before = previous.get(uid, TokenCount())
        added_in += now.input - before.input if now.input >= before.input else now.input
        added_out += now.output - before.output if now.output >= before.output else now.output
    return TokenCount(input=added_in, output=added_out), {**previous, **current}


def count_adapter_tokens(
    previous: Mapping[str, Mapping[str, TokenCount]],
    current: Mapping[str, Mapping[str, TokenCount]],
    namespace_of: Mapping[str, str],
) -> tuple[dict[str, TokenCount], dict[str, dict[str, TokenCount]]]:
    """Tokens served per LoRA adapter since the last read, keyed namespace/name (the engine serves an
    adapter under its LoRAAdapter's name, in the pod's namespace, or under its `namespace/name` on a base
    in another namespace: adapter_key), from each pod's per-adapter counters (pod uid -> adapter name ->
    counters; `namespace_of` is pod uid -> namespace).

    As count_tokens does per pod: an adapter first seen counts from zero, a counter that went down (the
    engine restarted, or unloaded and reloaded the adapter) counts from zero again. A pod read this time
    that no longer exports an adapter has unloaded it (its series go): its last counters are forgotten, so
    a later reload counts from zero. Pods not read this time keep their last counters."""
    added: dict[str, TokenCount] = {}
    for uid, adapters in current.items():
        before_pod = previous.get(uid, {})
        for name, now in adapters.items():
            before = before_pod.get(name, TokenCount())
            more_in = now.input - before.input if now.input >= before.input else now.input
            more_out = now.output - before.output if now.output >= before.output else now.output
            key = adapter_key(namespace_of.get(uid, UNKNOWN), name)
            sum_ = added.get(key, TokenCount())
            added[key] = TokenCount(input=sum_.input + more_in, output=sum_.output + more_out)
    counters = {uid: dict(a) for uid, a in previous.items()}
    counters.update({uid: dict(a) for uid, a in current.items()})
    return added, counters


def adapter_key(pod_namespace: str, name: str) -> str:
    """The LoRAAdapter (`namespace/name`) an engine in `pod_namespace` serves as `name`: its own namespace's
    adapter, or, for a name that is itself `namespace/name`, that adapter on a base it shares
    (flotilla.operator.desired.lora_adapter.served_name)."""
    return name if "/" in name else f"{pod_namespace}/{name}"


def shared_adapter_counters(
    counters: Mapping[str, Mapping[str, TokenCount]], namespaces: Iterable[str]
) -> dict[str, dict[str, TokenCount]]:
    """From pods of shared base services (pod uid -> adapter name -> counters), the counters of the adapters
    of `namespaces` (a tenant's: those served as `namespace/name` with the namespace among them) only."""
    mine = set(namespaces)
    return {
        uid: {name: c for name, c in adapters.items() if "/" in name and name.partition("/")[0] in mine}
        for uid, adapters in counters.items()
    }


def foreign_adapter_tokens(added: Mapping[str, TokenCount], namespaces: Iterable[str]) -> TokenCount:
    """Of the tokens added per adapter (count_adapter_tokens: `namespace/name` keys), those of adapters
    outside `namespaces`: other tenants' adapters that a shared Tenant's base serves. Their own tenants'
    rounds count them (shared_adapter_counters), so the shared Tenant's `tokens` leave them out and each
    token counts for one tenant only."""
    mine = set(namespaces)
    outside = [t for key, t in added.items() if key.partition("/")[0] not in mine]
    return TokenCount(input=sum(t.input for t in outside), output=sum(t.output for t in outside))


def adapter_usage(
    previous: Mapping[str, AdapterUsage],
    added: Mapping[str, TokenCount],
    existing: Iterable[str],
    cost_per_million_tokens: float | None,
) -> dict[str, AdapterUsage]:
    """Each existing LoRAAdapter's all-time tokens (namespace/name keys) and their share of the tenant's
    cost: its tokens at the tenant's cost per million tokens. Adapters that no longer exist are dropped
    (their tokens stay in the tenant's totals); tokens of a name no LoRAAdapter owns are not kept per
    adapter either, so the status stays bounded by the tenant's LoRAAdapter objects."""
    rate = cost_per_million_tokens or 0.0
    out = {}
    for key in sorted(set(existing)):
        before = previous.get(key, AdapterUsage())
        more = added.get(key, TokenCount())
        tokens_in, tokens_out = before.input + more.input, before.output + more.output
        out[key] = AdapterUsage(
            input=tokens_in, output=tokens_out, cost=round((tokens_in + tokens_out) * rate / 1e6, 6)
        )
    return out


def metered_end(pod: Mapping, ledger_until: float, **span_args) -> bool:
    """Whether the pod has ended and a round up to `ledger_until` has counted it to its end: its metering
    finalizer may go."""
    span = span_of(pod, **span_args)
    return span is None or (span.end is not None and span.end <= ledger_until)
