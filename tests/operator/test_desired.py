"""Desired state: the Deployment, Service and PDB built from a spec, without a cluster."""

from __future__ import annotations

import pytest

from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import (
    Decision,
    children,
    deployment,
    engine_flags,
    service,
    target_replicas,
)
from flotilla.operator.naming import SERVICE_LABEL
from flotilla.quantity import quantity_bytes


def _engine(dep: dict) -> dict:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def test_engine_command_serves_the_model_on_the_pod_ip(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(), decision, config)
    assert _engine(dep)["command"] == [
        "flotilla", "engine", "serve",
        "--model", "/models/tiny-llama",
        "--host", "$(POD_IP)",
        "--port", "8000",
        "--served-model-name", "tiny-llama",
        "--shutdown-delay", "5",
        "--drain-timeout", "45",
    ]  # fmt: skip


def test_served_name_defaults_to_the_service_name(owner, decision, config, make_spec):
    spec = make_spec(model={"uri": "file:///models/tiny-llama"})
    command = _engine(deployment(owner, spec, decision, config))["command"]
    assert command[command.index("--served-model-name") + 1] == "chat"


def test_engine_flags_follow_the_spec(make_spec):
    spec = make_spec(
        engine={
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 2048,
            "blockSize": 32,
            "kvCacheMemory": "2Gi",
            "prefixCaching": False,
            "dtype": "bfloat16",
            "extraArgs": ["--seed", "7"],
        }
    )
    assert engine_flags(spec.engine) == [
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "2048",
        "--block-size", "32",
        "--kv-cache-memory", str(2 * 1024**3),
        "--no-prefix-caching",
        "--dtype", "bfloat16",
        "--seed", "7",
    ]  # fmt: skip
    assert engine_flags(make_spec().engine) == []


def test_gpus_requests_limits_and_node_selector(owner, decision, config, make_spec):
    spec = make_spec(resources={"gpus": 2, "gpuType": "h100", "cpu": 4, "memory": "16Gi"})
    dep = deployment(owner, spec, decision, config)
    assert _engine(dep)["resources"] == {
        "requests": {"nvidia.com/gpu": "2", "cpu": "4", "memory": "16Gi"},
        "limits": {"nvidia.com/gpu": "2", "memory": "16Gi"},
    }
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"flotilla.dev/gpu-type": "h100"}


def test_cpu_only_service_has_no_gpu_fields(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(resources={"gpus": 0}), decision, config)
    pod = dep["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert _engine(dep)["resources"] == {}


def test_env_names_tenant_service_and_pod_ip(owner, decision, config, make_spec):
    env = {e["name"]: e for e in _engine(deployment(owner, make_spec(), decision, config))["env"]}
    assert env["FLOTILLA_TENANT"]["value"] == "team-a"
    assert env["FLOTILLA_SERVICE"]["value"] == "chat"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_probes_hit_health(owner, decision, config, make_spec):
    engine = _engine(deployment(owner, make_spec(), decision, config))
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    # A slow model load gets the startup budget before liveness can kill it.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_security_is_locked_down(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(), decision, config)
    pod = dep["spec"]["template"]["spec"]
    ctx = _engine(dep)["securityContext"]
    assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The read-only root still needs a scratch /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in _engine(dep)["volumeMounts"]


def test_rollout_never_drops_below_ready(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(), decision, config)
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert dep["spec"]["replicas"] == 2


def test_scrape_annotations_and_grace_period(owner, decision, config, make_spec):
    template = deployment(owner, make_spec(), decision, config)["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert template["spec"]["terminationGracePeriodSeconds"] == config.termination_grace_seconds


def test_every_child_is_owned_and_labelled(owner, decision, config, make_spec):
    kinds = []
    for obj in children(owner, make_spec(), decision, config):
        kinds.append(obj["kind"])
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a" and meta["name"] == "chat"
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "flotilla.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "chat",
            "uid": "0b5c-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["labels"][SERVICE_LABEL] == "chat"
        assert meta["labels"]["flotilla.dev/tenant"] == "team-a"
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget"]


def test_selector_does_not_depend_on_the_tenant(owner, config, make_spec):
    # Deployment selectors are immutable: a tenant change must not change them.
    a = deployment(owner, make_spec(), Decision("team-a", 1), config)
    b = deployment(owner, make_spec(), Decision("", 1), config)
    assert a["spec"]["selector"] == b["spec"]["selector"] == {"matchLabels": {SERVICE_LABEL: "chat"}}
    assert service(owner, Decision("", 1))["spec"]["selector"] == {SERVICE_LABEL: "chat"}


def test_desired_state_is_deterministic(owner, decision, config, make_spec):
    assert children(owner, make_spec(), decision, config) == children(owner, make_spec(), decision, config)


def test_pvc_model(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(model={"uri": "pvc://models/llama/8b"}), decision, config)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    command = _engine(dep)["command"]
    assert command[command.index("--model") + 1] == "/mnt/models/models/llama/8b"


def test_hf_model_from_local_cache(owner, decision, make_spec):
    cfg = OperatorConfig(hf_cache_dir="/var/cache/flotilla/hf")
    dep = deployment(owner, make_spec(model={"uri": "hf://acme/tiny"}), decision, cfg)
    command = _engine(dep)["command"]
    assert command[command.index("--model") + 1] == "/var/cache/flotilla/hf/acme/tiny"
    assert "initContainers" not in dep["spec"]["template"]["spec"]


def test_hf_model_fetched_by_init_container(owner, decision, config, make_spec):
    dep = deployment(owner, make_spec(model={"uri": "hf://acme/tiny"}), decision, config)
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert "hf://acme/tiny" in init["command"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize(
    ("replicas", "bounds", "expected"), [(3, None, 3), (9, (1, 4), 4), (0, (1, 4), 1), (2, (1, 4), 2)]
)
def test_replicas_stay_inside_autoscaling_bounds(replicas, bounds, expected, make_spec):
    extra = {} if bounds is None else {"autoscaling": {"minReplicas": bounds[0], "maxReplicas": bounds[1]}}
    assert target_replicas(make_spec(replicas=replicas, **extra)) == expected


def test_prefix_caching_is_the_engine_default(make_spec):
    assert engine_flags(make_spec(engine={"prefixCaching": True}).engine) == []


@pytest.mark.parametrize(
    ("text", "expected"), [("2Gi", 2 * 1024**3), ("500M", 500_000_000), (1024, 1024), ("1.5Ki", 1536)]
)
def test_quantity_bytes(text, expected):
    assert quantity_bytes(text) == expected


def test_bad_quantity_is_invalid(make_spec):
    from flotilla.operator.desired.validation import validate

    (p,) = validate(make_spec(engine={"kvCacheMemory": "lots"}), gpu_types={"h100"}, path_exists=None)
    assert p.field == "spec.engine.kvCacheMemory"
