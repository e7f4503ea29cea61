"""What the handlers share across calls, built once at start-up (`new_memo`, called by runner.py) and
handed to every handler by kopf as `memo`: `memo.runtime` is a Runtime, `memo.metering` a
MeteringState, `memo.admission` the webhook's QuotaLedger (its truth is in the API, not here), `memo.reviews`
the threads that admission reviews run on (webhook_reviews.py says why they are not kopf's). kopf gives each
object a shallow copy of the memo, so these objects are shared by all; handlers change them, never rebind them.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import kopf

from flotilla.operator.clients.kube import Kube
from flotilla.operator.clients.quota_ledger import QuotaLedger
from flotilla.operator.config import OperatorConfig
from flotilla.operator.tenancy.metering import Span
from flotilla.operator.tenancy.quota import Key, Ledger
from flotilla.operator.tenancy.settings import TenancySettings, WebhookSettings


@dataclass
class Runtime:
    """The reconciler's: configuration, the API client, and what it remembers between reconciles."""

    config: OperatorConfig
    kube: Kube
    webhook: WebhookSettings = field(default_factory=WebhookSettings)
    tenancy: TenancySettings = field(default_factory=TenancySettings)
    peering_name: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # plan-and-hold as one step; key_locks
    held: Ledger = field(default_factory=Ledger)  # the quota each service's Deployment holds
    held_seeded: bool = False
    # The last status we wrote, which may be newer than the index.
    written_status: dict[Key, dict] = field(default_factory=dict)
    refused: dict[Key, dict[str, str]] = field(default_factory=dict)  # kind -> why the API refused it
    key_locks: dict[Key, threading.Lock] = field(default_factory=dict)  # one plan at a time per service
    gpu_types: frozenset[str] = frozenset()
    namespace_labels: dict[str, dict] = field(default_factory=dict)  # as last seen, to spot label changes
    tenant_weights: dict[str, float] = field(default_factory=dict)  # schedulingWeight as last seen
    # Per namespace, the ports of the Service InferencePools' endpointPickerRef names, as last seen (None:
    # there is none), to spot the changes that alter the pools' ResolvedRefs.
    picker_ports: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    # One round of the picker's per-namespace Service and EndpointSlice at a time (picker_endpoints.py), and
    # the namespaces where a flotilla-gateway Service the operator did not make was last seen.
    picker_lock: threading.Lock = field(default_factory=threading.Lock)
    foreign_pickers: set[str] = field(default_factory=set)
    backstop_limits: dict[str, int] = field(default_factory=dict)  # namespace -> GPU limit last applied
    # Each autoscaled service's daemon waits on its event between decisions; a demand sets it (autoscaling.py).
    autoscaler_wake: dict[Key, asyncio.Event] = field(default_factory=dict)
    # One LoRAAdapter round at a time per adapter (lora_adapters.py): its timer and its change handlers.
    lora_locks: dict[Key, threading.Lock] = field(default_factory=dict)


@dataclass
class MeteringState:
    """Between metering rounds: spans of pods removed since the last round, and what RBAC was applied."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: dict[str, Span] = field(default_factory=dict)  # pod uid -> span of a removed pod
    applied: dict[str, str] = field(default_factory=dict)  # tenant -> digest of its RBAC/ResourceQuota
    # A pod that ended wakes its tenant's daemon, so its metering finalizer goes within a round trip.
    wake: dict[str, threading.Event] = field(default_factory=dict)


# Reviews wait on the API (reads, one conditional write), not on the CPU: eight answer a burst of eight
# concurrent creates at once on every replica.
REVIEW_THREADS = 8


def new_memo(runtime: Runtime) -> kopf.Memo:
    return kopf.Memo(
        runtime=runtime,
        metering=MeteringState(),
        admission=QuotaLedger(runtime.kube, runtime.webhook.namespace),
        reviews=ThreadPoolExecutor(max_workers=REVIEW_THREADS, thread_name_prefix="admission-review"),
    )
