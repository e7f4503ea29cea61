"""Desired state: pure functions from an InferenceService (plus what the operator decided about it) to the
Deployment, Service and PodDisruptionBudget that serve it. No I/O here; the kopf layer applies the result
with server-side apply, so every field written here is a field the operator owns and keeps.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from flotilla.contract import (
    ANNOTATION_PATH,
    ANNOTATION_PORT,
    ANNOTATION_SCRAPE,
    CRD_KNOBS,
    CRD_MODEL,
    CRD_QUANTITY,
    ENGINE_PORT,
    ENGINE_TOKEN_SECRET,
    ENGINE_TOKEN_SECRET_KEY,
    ENV_GATEWAY_TOKEN_SHA256,
    ENV_INTERNAL_TOKEN,
    ENV_NAMESPACE,
    ENV_POD_IP,
    ENV_SERVICE,
    ENV_TENANT,
    HEALTH_PATH,
    IMAGE_UID,
    METRICS_PATH,
    OPERATOR_KNOBS,
    SCHEDULING_FAIR,
    EngineArgs,
    engine_base_url,
    engine_serve_argv,
    engine_token,
    gateway_token,
    token_digest,
)
from flotilla.operator.api.v1alpha1 import (
    API_VERSION,
    INFERENCE_SERVICE,
    EngineSettings,
    InferenceServiceSpec,
)
from flotilla.operator.config import ENGINE_SHUTDOWN_DELAY, OperatorConfig
from flotilla.operator.desired import host_paths
from flotilla.operator.desired.model_source import (
    DRAFT_MODEL,
    LORA_ADAPTER_CLAIM,
    ModelMount,
    claim_mount,
    model_mount,
    parse_model_uri,
)
from flotilla.operator.naming import (
    GPU_RESOURCE,
    GPU_TYPE_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    child_labels,
    selector_labels,
)
from flotilla.quantity import quantity_bytes


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict:
        # controller=True: the garbage collector deletes children with the service, and tools show the owner.
        return {
            "apiVersion": API_VERSION,
            "kind": INFERENCE_SERVICE.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class Decision:
    """What the operator decided beyond the spec: the tenant, the replicas quota admits, and, for a service
    whose policy is fair, the Tenants' fair-share weights as sorted (tenant, weight) pairs, weight 1 left
    out (tenancy.rules.scheduling_weights)."""

    tenant: str
    replicas: int
    tenant_weights: tuple[tuple[str, float], ...] = ()


def served_name(owner: Owner, spec: InferenceServiceSpec) -> str:
    return spec.model.served_name or owner.name


def target_replicas(spec: InferenceServiceSpec) -> int:
    """spec.replicas, kept inside the autoscaling bounds when there are any."""
    if spec.autoscaling is None:
        return spec.replicas
    return max(spec.autoscaling.min_replicas, min(spec.replicas, spec.autoscaling.max_replicas))


DRAFT = "draft"


def engine_args(
    engine: EngineSettings,
    tenant_weights: tuple[tuple[str, float], ...] = (),
    draft_model_path: str | None = None,
) -> EngineArgs:
    """The spec's engine settings as the contract's EngineArgs: each knob's value from the field the
    contract's table names (CRD_KNOBS; unset ones keep the engine's defaults). A quantity becomes bytes; a
    model source becomes `draft_model_path`, where the pod mounts spec.engine.speculative.model
    (draft_mount, for the draft method only; without one, no flag). The tenant weights go only to a fair
    engine: under another policy they would mean nothing, and would roll its pods each time a Tenant's weight
    changed."""
    wire = engine.to_wire()
    values: dict[str, object] = {}
    for name, knob in CRD_KNOBS.items():
        value = _field(wire, knob.crd)
        if value is not None and knob.crd_value == CRD_QUANTITY:
            value = quantity_bytes(value)
        elif value is not None and knob.crd_value == CRD_MODEL:
            value = draft_model_path
        values[name] = value
    if engine.scheduling_policy == SCHEDULING_FAIR:
        values.update(
            (name, tuple(tenant_weights)) for name, knob in OPERATOR_KNOBS.items() if knob.from_tenants
        )
    return EngineArgs(**values, extra_args=engine.extra_args)


def _field(wire: dict, path: str | None) -> Any:
    """The value at a dotted camelCase path of a wire dict, or None where any part is unset."""
    value: Any = wire
    for part in (path or "").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def engine_flags(engine: EngineSettings) -> list[str]:
    """`flotilla engine serve` flags for the engine settings in the spec."""
    return engine_args(engine).flags()


def engine_command(
    owner: Owner,
    spec: InferenceServiceSpec,
    model_path: str,
    drain_seconds: int | None = None,
    tenant_weights: tuple[tuple[str, float], ...] = (),
    draft_model_path: str | None = None,
) -> list[str]:
    return engine_serve_argv(
        model_path=model_path,
        served_name=served_name(owner, spec),
        shutdown_delay=ENGINE_SHUTDOWN_DELAY if drain_seconds else None,
        drain_timeout=drain_seconds or None,
        engine=engine_args(spec.engine, tenant_weights, draft_model_path),
    )


def draft_mount(spec: InferenceServiceSpec, config: OperatorConfig, image: str) -> ModelMount | None:
    """The speculative draft model's mount (DRAFT_MODEL's volume, mount root and init container, so it
    cannot collide with the served model's), or None without one. A draft that is the served model itself
    is mounted once: its path, and no volume of its own."""
    speculative = spec.engine.speculative
    if speculative is None or speculative.method != DRAFT or speculative.model is None:
        return None
    draft = parse_model_uri(speculative.model.uri)
    if draft == parse_model_uri(spec.model.uri):
        return ModelMount(path=model_mount(draft, config, image).path)
    return model_mount(draft, config, image, DRAFT_MODEL)


LORA_ADAPTERS_VOLUME = "lora-adapters"


def lora_adapter_mount(spec: InferenceServiceSpec) -> ModelMount:
    """Where the replicas read LoRAAdapters' files from, read-only: spec.engine.lora.adapterDir at its own
    path (a hostPath, under one of the platform's allowed roots: validation refuses any other before a pod
    is built), so that a file:// source is the same path in the pod as on the node; and
    spec.engine.lora.adapterClaim as a pvc:// model's claim is mounted (claim_mount, at
    /mnt/lora-adapters/<claim>), where a pvc:// source's folder is (desired/lora_adapter.adapter_path).
    Nothing when both are unset or LoRA is off (the path is adapterDir's, or empty)."""
    lora = spec.engine.lora
    if lora is None or not lora.enabled:
        return ModelMount(path="")
    mount = ModelMount(path="")
    if lora.adapter_dir:
        path = host_paths.normalize(lora.adapter_dir)  # as validation checked it against the allowed roots
        mount = ModelMount(
            path=path,
            volumes=[{"name": LORA_ADAPTERS_VOLUME, "hostPath": {"path": path, "type": "Directory"}}],
            mounts=[{"name": LORA_ADAPTERS_VOLUME, "mountPath": path, "readOnly": True}],
        )
    if lora.adapter_claim:
        claim = claim_mount(lora.adapter_claim, "", LORA_ADAPTER_CLAIM)
        mount.volumes += claim.volumes
        mount.mounts += claim.mounts
    return mount


def _resources(spec: InferenceServiceSpec) -> dict:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.resources.gpus:
        # Extended resources must have requests == limits.
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(spec.resources.gpus)
    if spec.resources.cpu is not None:
        requests["cpu"] = str(spec.resources.cpu)
    if spec.resources.memory is not None:
        # Memory is not compressible: a limit equal to the request avoids surprise OOM kills of neighbours.
        requests["memory"] = limits["memory"] = str(spec.resources.memory)
    out: dict[str, dict] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def _env(owner: Owner, tenant: str, config: OperatorConfig) -> list[dict]:
    env = [
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": ENV_TENANT, "value": tenant},
        {"name": ENV_SERVICE, "value": owner.name},
        {"name": ENV_NAMESPACE, "value": owner.namespace},
        # A writable HOME under the read-only root filesystem.
        {"name": "HOME", "value": "/tmp"},
    ]
    if config.engine_token_master is not None:
        # The namespace's internal token (engine_token_secret), which adapter loads need: the operator's.
        # From the Secret, so that it appears in no pod spec.
        secret = {"name": ENGINE_TOKEN_SECRET, "key": ENGINE_TOKEN_SECRET_KEY}
        env.append({"name": ENV_INTERNAL_TOKEN, "valueFrom": {"secretKeyRef": secret}})
        # Only the digest of the gateway's credential, which lets a request name its tenant: whoever reads
        # the pod spec learns nothing that would pass.
        digest = token_digest(gateway_token(config.engine_token_master))
        env.append({"name": ENV_GATEWAY_TOKEN_SHA256, "value": digest})
    return env


def pod_template(
    owner: Owner, spec: InferenceServiceSpec, decision: Decision, config: OperatorConfig
) -> dict:
    image = spec.image or config.default_image
    mount = model_mount(parse_model_uri(spec.model.uri), config, image)
    draft = draft_mount(spec, config, image)
    models = [mount] if draft is None else [mount, draft]
    lora = lora_adapter_mount(spec)
    container = {
        "name": "engine",
        "image": image,
        # On SIGTERM the engine serves on while endpoints drop it, then drains in-flight requests; both
        # must end, with 10 s to spare, before the grace period does.
        "command": engine_command(
            owner,
            spec,
            mount.path,
            max(1, config.termination_grace_seconds - 10 - ENGINE_SHUTDOWN_DELAY),
            decision.tenant_weights,
            draft.path if draft else None,
        ),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(owner, decision.tenant, config),
        "resources": _resources(spec),
        "readinessProbe": _probe(HEALTH_PATH, period=5, failures=3),
        "livenessProbe": _probe(HEALTH_PATH, period=10, failures=3),
        "startupProbe": _probe(
            HEALTH_PATH, period=config.startup_probe_period_seconds, failures=config.startup_probe_failures
        ),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            *(m for model in models for m in model.mounts),
            *lora.mounts,
        ],
    }
    pod_spec: dict = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": config.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_UID,
            "runAsGroup": IMAGE_UID,
            "fsGroup": IMAGE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            *(v for model in models for v in model.volumes),
            *lora.volumes,
        ],
    }
    init_containers = [init for model in models for init in model.init_containers]
    if init_containers:
        pod_spec["initContainers"] = [
            {**init, "securityContext": container["securityContext"]} for init in init_containers
        ]
    if spec.resources.gpu_type:
        pod_spec["nodeSelector"] = {GPU_TYPE_LABEL: spec.resources.gpu_type}
    if spec.resources.gpus:
        # GPU nodes are commonly tainted so that only GPU pods land there.
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "metadata": {
            "labels": child_labels(owner.name, decision.tenant),
            "annotations": {
                ANNOTATION_SCRAPE: "true",
                ANNOTATION_PORT: str(ENGINE_PORT),
                ANNOTATION_PATH: METRICS_PATH,
            },
        },
        "spec": pod_spec,
    }


def child_metadata(owner: Owner, decision: Decision) -> dict:
    """Name, namespace, labels and the owner reference every child of a service carries."""
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": child_labels(owner.name, decision.tenant),
        "ownerReferences": [owner.reference()],
    }


def deployment(owner: Owner, spec: InferenceServiceSpec, decision: Decision, config: OperatorConfig) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, decision),
        "spec": {
            "replicas": decision.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # Never below the ready count during a rollout: a new pod must be ready before an old one goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": config.startup_probe_period_seconds * config.startup_probe_failures
            + 60,
            "template": pod_template(owner, spec, decision, config),
        },
    }


def service(owner: Owner, decision: Decision) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, decision),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner, decision: Decision) -> dict:
    # One pod at a time on voluntary disruptions (drains): a single-replica service can still be drained.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, decision),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def children(
    owner: Owner, spec: InferenceServiceSpec, decision: Decision, config: OperatorConfig
) -> list[dict]:
    """The workload one InferenceService owns, in the order to apply it (reconcile.plan adds its
    InferencePool after it: desired/inference_pool.py)."""
    return [
        deployment(owner, spec, decision, config),
        service(owner, decision),
        pod_disruption_budget(owner, decision),
    ]


def engine_token_secret(namespace: str, master: str) -> dict:
    """The Secret with the internal token of the engines in `namespace`, derived from the installation's
    master token (--engine-token-file). Shared by every InferenceService of the namespace, so owned by none:
    an owner reference to one service would delete it under the others. It outlives the last service of
    its namespace; without engines there it grants nothing."""
    token = engine_token(master, namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": ENGINE_TOKEN_SECRET,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY},
        },
        "type": "Opaque",
        # data, not stringData: server-side apply tracks data (stringData is write-only).
        "data": {ENGINE_TOKEN_SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


def shared_objects(namespace: str, config: OperatorConfig) -> list[dict]:
    """What the services of a namespace share, applied with each one's children: the engine token's Secret
    when the operator has a master token, else nothing."""
    if config.engine_token_master is None:
        return []
    return [engine_token_secret(namespace, config.engine_token_master)]


def service_url(owner: Owner) -> str:
    return engine_base_url(f"{owner.name}.{owner.namespace}.svc")
