"""The backstop: each of a Tenant's namespaces gets a ResourceQuota on requests.nvidia.com/gpu so that the
API server itself refuses GPU pods beyond the tenant's total quota, whoever creates them (a member, an
admin, another controller). Pure.

A ResourceQuota limits one namespace, and a tenant may own several, so the tenant's total is partitioned:
each namespace's limit is what it holds (the larger of the operator's grants there and the GPUs its pods
request now) plus a share of the tenant's free GPUs, the free GPUs split evenly (the remainder to the
first namespaces by name). The limits sum to the quota, so the namespaces together can never pass it,
however pods are created in them at once; the API server enforces each namespace's limit atomically.

The price of a hard partition: a pod made outside Flotilla can use only its namespace's share of the
free GPUs, not all of them. The operator raises a namespace's limit before it grants a service there
more GPUs (controllers/backstop.py), so its own scale-ups never wait on the partition. Where pods already
hold more than the quota (made before the backstop existed, or the quota was lowered), the limits are
what is held: nothing new starts until use falls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flotilla.operator.naming import GPU_RESOURCE


def namespace_limits(
    quota: int, namespaces: Sequence[str], granted: Mapping[str, int], in_use: Mapping[str, int]
) -> dict[str, int]:
    """GPUs each namespace may request. `quota`: the tenant's total over its GPU types; `granted`: what the
    operator has granted the services in each namespace; `in_use`: what the pods there request now."""
    names = sorted(set(namespaces))
    if not names:
        return {}
    held = {ns: max(granted.get(ns, 0), in_use.get(ns, 0)) for ns in names}
    free = max(0, quota - sum(held.values()))
    share, remainder = divmod(free, len(names))
    return {ns: held[ns] + share + (1 if i < remainder else 0) for i, ns in enumerate(names)}


def resource_quota(metadata: Mapping, gpus: int) -> dict:
    """The ResourceQuota object that limits a namespace to `gpus` GPUs."""
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": dict(metadata),
        "spec": {"hard": {f"requests.{GPU_RESOURCE}": str(gpus)}},
    }
