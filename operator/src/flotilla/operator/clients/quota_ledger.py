"""The admission webhook's reads and writes: a fresh picture of the tenancy world, the stored objects a
tenant is charged for (InferenceServices, LoRAAdapters), and each Tenant's reservations, a ConfigMap
written with optimistic concurrency (tenancy/reservations.py says why, and why it is read before the
stored objects are listed).

Every read here goes to the API server, never to a watch index: the standby replicas of the operator
answer reviews too, and their indexes are paused. Lists without a resourceVersion are consistent reads,
so a review sees every object stored before it started.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import cast

from kubernetes.client.exceptions import ApiException

from flotilla.operator.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    INFERENCE_SERVICE,
    LORA_ADAPTER,
    TENANT,
    VERSION,
    TenantSpec,
)
from flotilla.operator.clients.kube import Kube
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.naming import MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL
from flotilla.operator.tenancy.quota import Key
from flotilla.operator.tenancy.reservations import (
    Reserved,
    adapter_data_key,
    data_key,
    parse,
    serialize,
    without,
)

RESERVATIONS_PREFIX = "flotilla-quota-"
CLAIMS_NAME = "flotilla-tenant-claims"  # Tenants admitted moments ago, with what they claim


@dataclass
class World:
    """Tenants and namespaces' labels, as the API has them now."""

    tenants: dict[str, TenantSpec] = field(default_factory=dict)
    tenant_uids: dict[str, str] = field(default_factory=dict)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)


def reservations_name(tenant: str) -> str:
    name = RESERVATIONS_PREFIX + tenant
    if len(name) <= 253:
        return name
    return RESERVATIONS_PREFIX + hashlib.sha256(tenant.encode()).hexdigest()[:32]


class QuotaLedger:
    def __init__(self, kube: Kube, namespace: str):
        self.kube, self.namespace = kube, namespace

    def world(self) -> World:
        custom, core = self.kube.custom, self.kube.core
        world = World()
        API_CALLS.labels(verb="list", resource="tenants").inc()
        listed = cast(dict, custom.list_cluster_custom_object(GROUP, VERSION, TENANT.plural))
        for obj in listed.get("items", []):
            name = obj["metadata"]["name"]
            try:
                world.tenants[name] = TenantSpec.model_validate(obj.get("spec") or {})
            except ValueError:
                continue  # a Tenant we cannot read claims nothing (the index readers do the same)
            world.tenant_uids[name] = obj["metadata"].get("uid", "")
        API_CALLS.labels(verb="list", resource="namespaces").inc()
        for ns in core.list_namespace().items:
            world.labels[ns.metadata.name] = dict(ns.metadata.labels or {})
        return world

    def services(self) -> dict[Key, dict]:
        """Every stored InferenceService: (namespace, name) -> the object."""
        return self._stored(INFERENCE_SERVICE.plural)

    def adapters(self) -> dict[Key, str]:
        """Every stored LoRAAdapter: (namespace, name) -> its uid."""
        return {
            key: (obj["metadata"].get("uid") or "") for key, obj in self._stored(LORA_ADAPTER.plural).items()
        }

    def _stored(self, plural: str) -> dict[Key, dict]:
        API_CALLS.labels(verb="list", resource=plural).inc()
        listed = cast(dict, self.kube.custom.list_cluster_custom_object(GROUP, VERSION, plural))
        return {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed.get("items", [])}

    def read(self, tenant: str) -> tuple[Reserved, str | None]:
        """The tenant's reservations and the ConfigMap's resourceVersion (None: it does not exist yet)."""
        data, version = self._read(reservations_name(tenant))
        return parse(tenant, data), version

    def write(self, tenant: str, tenant_uid: str, reserved: Reserved, resource_version: str | None) -> bool:
        """Replace the tenant's reservations if nobody wrote them since `resource_version` was read; False
        when somebody did (the caller reads again and decides again)."""
        # Collected with its Tenant.
        owner = [{"apiVersion": API_VERSION, "kind": TENANT.kind, "name": tenant, "uid": tenant_uid}]
        labels = {TENANT_LABEL: tenant, MANAGED_BY_LABEL: MANAGED_BY}
        return self._write(
            reservations_name(tenant),
            serialize(reserved),
            resource_version,
            labels,
            owner if tenant_uid else [],
        )

    def read_claims(self) -> tuple[dict[str, str], str | None]:
        """Namespace claims of Tenants admitted moments ago (tenancy/reservations.py's claims)."""
        return self._read(CLAIMS_NAME)

    def write_claims(self, data: dict[str, str], resource_version: str | None) -> bool:
        return self._write(CLAIMS_NAME, data, resource_version, {MANAGED_BY_LABEL: MANAGED_BY}, [])

    def _read(self, name: str) -> tuple[dict[str, str], str | None]:
        API_CALLS.labels(verb="get", resource="configmaps").inc()
        try:
            cm = self.kube.core.read_namespaced_config_map(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return {}, None
            raise
        return dict(cm.data or {}), cm.metadata.resource_version

    def _write(
        self, name: str, data: dict[str, str], resource_version: str | None, labels: dict, owners: list[dict]
    ) -> bool:
        """A create (no version) or a replace conditional on `resource_version`; False on a conflict."""
        body: dict = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "ownerReferences": owners,
            },
            "data": data,
        }
        try:
            if resource_version is None:
                API_CALLS.labels(verb="create", resource="configmaps").inc()
                self.kube.core.create_namespaced_config_map(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = resource_version
                API_CALLS.labels(verb="update", resource="configmaps").inc()
                self.kube.core.replace_namespaced_config_map(name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # Conflict (stale resourceVersion) or AlreadyExists (a concurrent create)
                return False
            raise
        return True

    def release(self, key: Key, uid: str, *, adapter: bool = False, attempts: int = 5) -> None:
        """Drops the reservation a deleted InferenceService (or, with `adapter`, LoRAAdapter) of this uid
        still holds, in whichever Tenant's ConfigMap it is (its namespace may have changed owner since)."""
        entry = adapter_data_key(key) if adapter else data_key(key)
        API_CALLS.labels(verb="list", resource="configmaps").inc()
        found = self.kube.core.list_namespaced_config_map(
            self.namespace, label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY},{TENANT_LABEL}"
        ).items
        for cm in found:
            tenant = (cm.metadata.labels or {}).get(TENANT_LABEL, "")
            if entry not in (cm.data or {}):
                continue
            for _ in range(attempts):
                reserved, version = self.read(tenant)
                kept = without(reserved, key, uid, adapter=adapter)
                if kept == reserved:
                    break
                owner = (cm.metadata.owner_references or [None])[0]
                if self.write(tenant, owner.uid if owner else "", kept, version):
                    break
