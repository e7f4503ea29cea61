"""The engines' internal token (--engine-token-file): the namespace's Secret and the engine's env, present
only when the operator has a master token; and the least RBAC that writes it."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from flotilla.cli import build_parser
from flotilla.contract import (
    ENGINE_TOKEN_SECRET,
    ENGINE_TOKEN_SECRET_KEY,
    ENV_GATEWAY_TOKEN_SHA256,
    ENV_INTERNAL_TOKEN,
    engine_token,
    gateway_token,
    token_matches,
)
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.cmd.cli import read_engine_token
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.desired.workload import deployment, engine_token_secret, shared_objects
from flotilla.operator.manifests.rbac import cluster_rules
from flotilla.operator.naming import MANAGED_BY, MANAGED_BY_LABEL

MASTER = "the-installation-master-token"


def _env(dep: dict) -> dict[str, dict]:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_without_a_master_token_nothing_changes(owner, decision, config, make_spec):
    assert config.engine_token_master is None
    env = _env(deployment(owner, make_spec(), decision, config))
    assert ENV_INTERNAL_TOKEN not in env and ENV_GATEWAY_TOKEN_SHA256 not in env
    assert shared_objects("team-a", config) == []


def test_the_engine_reads_its_token_from_the_namespace_secret(owner, decision, config, make_spec):
    config = dataclasses.replace(config, engine_token_master=MASTER)
    env = _env(deployment(owner, make_spec(), decision, config))
    assert env[ENV_INTERNAL_TOKEN] == {
        "name": ENV_INTERNAL_TOKEN,
        "valueFrom": {"secretKeyRef": {"name": ENGINE_TOKEN_SECRET, "key": ENGINE_TOKEN_SECRET_KEY}},
    }
    assert MASTER not in str(deployment(owner, make_spec(), decision, config))


def test_the_pod_spec_holds_only_the_digest_of_the_gateways_credential(owner, decision, config, make_spec):
    config = dataclasses.replace(config, engine_token_master=MASTER)
    dep = deployment(owner, make_spec(), decision, config)
    digest = _env(dep)[ENV_GATEWAY_TOKEN_SHA256]["value"]
    assert token_matches(gateway_token(MASTER), digest)
    assert gateway_token(MASTER) not in str(dep)  # the credential itself is nowhere in the spec
    assert not token_matches(digest, digest)
    assert gateway_token(MASTER) != engine_token(MASTER, "team-a")  # not any namespace's operator token


@pytest.mark.parametrize("namespace", ["team-a", "team-b"])
def test_the_secret_holds_the_namespace_token(namespace):
    secret = engine_token_secret(namespace, MASTER)
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", ENGINE_TOKEN_SECRET)
    assert secret["metadata"]["namespace"] == namespace
    assert secret["metadata"]["labels"] == {MANAGED_BY_LABEL: MANAGED_BY}
    assert "ownerReferences" not in secret["metadata"]  # shared by the namespace's services
    token = base64.b64decode(secret["data"][ENGINE_TOKEN_SECRET_KEY]).decode()
    assert token == engine_token(MASTER, namespace)
    assert MASTER not in str(secret)


def test_engine_tokens_differ_per_namespace():
    assert engine_token(MASTER, "team-a") != engine_token(MASTER, "team-b")


def _plan(config: OperatorConfig):
    obj = {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {"model": {"uri": "file:///models/tiny"}, "resources": {"gpus": 1, "gpuType": "h100"}},
    }
    world = World(
        config=dataclasses.replace(config, host_path_roots=("/models",)),
        now="2030-01-01T00:00:00Z",
        gpu_types={"h100"},
        tenants={"team-a": TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 4})},
        held_by_others=[],
        deployment=None,
        path_exists=lambda _p: True,
    )
    return plan(obj, world)


def test_the_plan_applies_the_secret_before_the_engines_only_with_the_setting():
    with_token = _plan(OperatorConfig(engine_token_master=MASTER))
    kinds = [c["kind"] for c in with_token.children]
    assert kinds == ["Secret", "Deployment", "Service", "PodDisruptionBudget", "InferencePool"]
    assert with_token.children[0] == engine_token_secret("team-a", MASTER)
    without = _plan(OperatorConfig())
    assert [c["kind"] for c in without.children] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "InferencePool",
    ]


def test_the_master_is_not_in_the_config_repr():
    assert MASTER not in repr(OperatorConfig(engine_token_master=MASTER))


def test_the_flag_reads_the_file(tmp_path):
    path = tmp_path / "master"
    path.write_text(f"{MASTER}\n")
    assert read_engine_token(path) == MASTER
    assert read_engine_token(None) is None
    path.write_text("  \n")
    with pytest.raises(SystemExit, match="empty"):
        read_engine_token(path)
    with pytest.raises(SystemExit, match="engine-token-file"):
        read_engine_token(tmp_path / "missing")


def test_secrets_rbac_writes_that_one_name_and_reads_none():
    rules = [r for r in cluster_rules() if "secrets" in r["resources"]]
    assert rules == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [ENGINE_TOKEN_SECRET],
            "verbs": ["create", "patch"],
        }
    ]


def test_operator_run_takes_the_flag(tmp_path):
    args = build_parser().parse_args(["operator", "run", "--engine-token-file", str(tmp_path / "master")])
    assert args.engine_token_file == tmp_path / "master"
    assert build_parser().parse_args(["operator", "run"]).engine_token_file is None
