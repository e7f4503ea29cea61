"""Least-privilege RBAC for the operator: exactly the verbs its code uses, each with the reason.

`flotilla operator rbac` writes deploy/operator-rbac.yaml from this; a test fails when the file drifts.
The e2e tests run the operator under this identity, so a missing verb fails them.
"""

from __future__ import annotations

from flotilla import manifest_yaml
from flotilla.contract import ENGINE_TOKEN_SECRET
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, LORA_ADAPTER, TENANT
from flotilla.operator.desired.picker_endpoints import SLICE_NAME
from flotilla.operator.tenancy import rbac as tenant_rbac

NAMESPACE = "flotilla-system"  # the operator's own; MANIFEST_FILE is rendered for it
MANIFEST_FILE = "deploy/operator-rbac.yaml"  # relative to the repository root
SERVICE_ACCOUNT = "flotilla-operator"
PEERING = "flotilla"  # the ClusterKopfPeering object the operator's replicas meet in
ROLE = "flotilla-operator"

# (apiGroup, resources, verbs, why). Server-side apply is a PATCH, and needs create when the object is new.
RULES: list[tuple[str, list[str], list[str], str]] = [
    (
        GROUP,
        [INFERENCE_SERVICE.plural],
        ["get", "list", "watch", "patch"],
        "reconcile; kopf's progress annotations",
    ),
    (GROUP, [f"{INFERENCE_SERVICE.plural}/status"], ["get", "patch"], "write conditions and replicas"),
    (GROUP, [f"{INFERENCE_SERVICE.plural}/scale"], ["get", "patch"], "the autoscaler sets replicas"),
    (
        GROUP,
        [f"{INFERENCE_SERVICE.plural}/finalizers"],
        ["update"],
        "ownerReferences with blockOwnerDeletion",
    ),
    (GROUP, [TENANT.plural], ["get", "list", "watch"], "which tenant owns a namespace, and its quota"),
    (
        GROUP,
        [LORA_ADAPTER.plural],
        ["get", "list", "watch", "patch"],
        "load adapters into replicas; the unload finalizer; the webhook counts a tenant's adapters",
    ),
    (GROUP, [f"{LORA_ADAPTER.plural}/status"], ["get", "patch"], "each replica's phase and the conditions"),
    ("apps", ["deployments"], ["get", "list", "watch", "create", "patch"], "engine pods; drift correction"),
    (
        "",
        ["services"],
        ["get", "list", "watch", "create", "patch"],
        "the service's stable address; the picker's Service flotilla-gateway in each namespace with services",
    ),
    (
        "discovery.k8s.io",
        ["endpointslices"],
        ["get", "list", "watch"],
        "the picker's EndpointSlices (drift); writes are limited by name below",
    ),
    ("policy", ["poddisruptionbudgets"], ["get", "list", "watch", "create", "patch"], "drain safety"),
    (
        gie.GROUP,
        [gie.PLURAL],
        ["get", "list", "watch", "create", "patch"],
        "one InferencePool per service, for Gateway API Inference Extension gateways; drift correction",
    ),
    (
        gie.GROUP,
        [f"{gie.PLURAL}/status"],
        ["get", "patch"],
        "the pools' status.parents entry for Flotilla's gateway",
    ),
    (
        "",
        ["pods"],
        ["get", "list", "watch", "patch"],
        "status: readiness, restarts, endpoints; the metering finalizer on engine pods",
    ),
    ("", ["nodes"], ["get", "list", "watch"], "which GPU types exist, for validation"),
    ("", ["events"], ["create"], "Warning and Normal events on InferenceServices"),
    (
        "apiextensions.k8s.io",
        ["customresourcedefinitions"],
        ["get", "list", "watch"],
        "kopf resource discovery",
    ),
    ("", ["namespaces"], ["get", "list", "watch"], "kopf namespace discovery"),
    (
        "kopf.dev",
        ["clusterkopfpeerings"],
        ["get", "list", "watch", "create", "patch"],
        "kopf peering: one active operator; created at start (a chart cannot ship it beside its CRD)",
    ),
]

# Rules limited to objects of one name: (apiGroup, resources, resourceNames, verbs, why). Server-side apply
# of a new object is authorized as a create of that name, so `create` can be limited by name here too.
NAMED_RULES: list[tuple[str, list[str], list[str], list[str], str]] = [
    (
        "",
        ["secrets"],
        [ENGINE_TOKEN_SECRET],
        ["create", "patch"],
        "the engines' internal token in each namespace with InferenceServices (--engine-token-file); "
        "written by server-side apply, never read",
    ),
    (
        "discovery.k8s.io",
        ["endpointslices"],
        [SLICE_NAME],
        ["create", "patch"],
        "the gateway's pods behind the picker's Service in each namespace with services (the pools' "
        "endpointPickerRef); removed by the garbage collector",
    ),
]


def cluster_rules() -> list[dict]:
    """The operator's ClusterRole rules: deploy/operator-rbac.yaml and the Helm chart both carry these."""
    rules = [
        {"apiGroups": [group], "resources": resources, "verbs": verbs}
        for group, resources, verbs, _why in RULES + tenant_rbac.OPERATOR_RULES
    ]
    named = [
        {"apiGroups": [group], "resources": resources, "resourceNames": names, "verbs": verbs}
        for group, resources, names, verbs, _why in NAMED_RULES
    ]
    return [*rules, *named, tenant_rbac.BIND_RULE]


def manifests(namespace: str) -> list[dict]:
    rules = cluster_rules()
    labels = {"app.kubernetes.io/name": "flotilla-operator"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace, "labels": labels},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": ROLE, "labels": labels},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": ROLE, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}],
        },
        *_tenancy_manifests(namespace, labels),
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": PEERING, "labels": labels},
        },
    ]


def _tenancy_manifests(namespace: str, labels: dict) -> list[dict]:
    """The member role every Tenant's RoleBindings grant, and the Secret access for the webhook's CA."""
    meta = {"name": ROLE, "namespace": namespace, "labels": labels}
    return [
        tenant_rbac.member_cluster_role(),
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": tenant_rbac.SECRET_RULES},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}],
        },
    ]  # fmt: skip


def render(namespace: str) -> str:
    header = "# Generated from operator/src/rbac.py by `flotilla operator rbac`. Do not edit by hand.\n"
    notes = "".join(
        f"#   {group or 'core'}/{','.join(res)}: {','.join(verbs)} -- {why}\n"
        for group, res, verbs, why in RULES + tenant_rbac.OPERATOR_RULES
    ) + "".join(
        f"#   {group or 'core'}/{','.join(res)} named {','.join(names)}: {','.join(verbs)} -- {why}\n"
        for group, res, names, verbs, why in NAMED_RULES
    )
    return (
        header
        + "# Why each rule exists:\n"
        + notes
        + manifest_yaml.dump_all(manifests(namespace), sort_keys=False)
    )
