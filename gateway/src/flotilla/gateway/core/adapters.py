"""What the gateway knows about a LoRAAdapter (docs/lora.md, "In the fleet"), from the raw Kubernetes JSON
of the object: its namespace and name (the name requests send as "model"), its base InferenceService (in
spec.serviceNamespace, or the same namespace), the adapter's name in the base's engines (engine_name: the
object's name, or `namespace/name` on a base in another namespace, as the operator loads it), and per
replica of that base whether the operator reports it Loaded, Loading or Failed there.

The gateway never loads an adapter: the operator does, into every ready replica, within one of its rounds
(10 s). The gateway routes an adapter's requests only to replicas whose status says Loaded
(services.ModelIndex turns an adapter into a routing view of its base), and holds them meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flotilla.ownership import Owner

LOADED, LOADING, FAILED = "Loaded", "Loading", "Failed"
# The Ready condition's reasons (flotilla.operator.desired.lora_adapter) that no replica's load can end:
# the object or its base must change first. A request for such an adapter is refused at once, with the
# operator's message, rather than held.
BLOCKED_REASONS = frozenset({"Invalid", "BaseServiceNotFound", "BaseServiceInvalid", "LoRANotEnabled",
                             "NoAdapterDir", "SourceOutsideAdapterDir", "NoAdapterClaim",
                             "SourceOutsideAdapterClaim", "NameTaken", "BaseNotShared"})  # fmt: skip


@dataclass(frozen=True)
class AdapterView:
    namespace: str
    name: str  # what clients send as "model"
    service: str  # spec.inferenceService: the base InferenceService's name, in `service_namespace`
    tenant: str | None  # the Tenant owning the namespace (flotilla.ownership's one rule)
    contested: bool = False
    shared: bool = False  # the namespace is the platform's shared Tenant's (ownership.Owner.shared)
    loaded_pods: frozenset[str] = frozenset()  # pods of the base whose status entry is Loaded
    failures: tuple[tuple[str, str], ...] = ()  # (pod, why) for each Failed entry, sorted by pod
    pending: int = 0  # entries still Loading
    blocked: str | None = None  # the operator's message when Ready is False for a BLOCKED_REASONS reason
    service_namespace: str = ""  # spec.serviceNamespace; empty: `namespace`

    @property
    def key(self) -> str:
        """`namespace/name`: the adapter's id among adapters (a model name clients may send)."""
        return f"{self.namespace}/{self.name}"

    @property
    def base_namespace(self) -> str:
        return self.service_namespace or self.namespace

    @property
    def service_key(self) -> str:
        return f"{self.base_namespace}/{self.service}"

    @property
    def engine_name(self) -> str:
        """The adapter's name in its base's engines (flotilla.operator.desired.lora_adapter.served_name: the
        object's name, or `namespace/name` on a base in another namespace)."""
        return self.name if self.base_namespace == self.namespace else self.key


def adapter_view(obj: dict[str, Any], owner_of_namespace: Callable[[str], Owner]) -> AdapterView:
    """The view of a LoRAAdapter object; a status the operator has not written yet means loaded nowhere."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
    owner = owner_of_namespace(namespace)
    loaded, failures, pending = set(), [], 0
    for entry in status.get("replicas") or []:
        if not isinstance(entry, dict) or not entry.get("pod"):
            continue
        phase = entry.get("phase")
        if phase == LOADED:
            loaded.add(entry["pod"])
        elif phase == FAILED:
            why = entry.get("message") or entry.get("reason") or "the engine refused it"
            failures.append((entry["pod"], why))
        else:
            pending += 1
    blocked = None
    for condition in status.get("conditions") or []:
        if (
            isinstance(condition, dict)
            and condition.get("type") == "Ready"
            and condition.get("status") == "False"
            and condition.get("reason") in BLOCKED_REASONS
        ):
            blocked = condition.get("message") or condition["reason"]
    return AdapterView(
        namespace=namespace,
        name=name,
        service=spec.get("inferenceService") or "",
        tenant=owner.tenant,
        contested=owner.contested,
        shared=owner.shared,
        loaded_pods=frozenset(loaded),
        failures=tuple(sorted(failures)),
        pending=pending,
        blocked=blocked,
        service_namespace=spec.get("serviceNamespace") or namespace,
    )
