import os

import pytest

from flotilla.cluster.pod_env import EnvError, base_env, container_argv, container_env, expand, pod_path

POD = {
    "metadata": {"name": "web-1", "namespace": "team-a", "uid": "u-1", "labels": {"app": "web"}},
    "spec": {"nodeName": "gpu-node-0", "serviceAccountName": "default"},
}


def no_lookup(_ns, _name):
    return None


def test_expand_follows_kubernetes_rules():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"


def test_field_refs_configmaps_and_secrets():
    container = {
        "name": "c",
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "URL", "value": "http://$(POD_IP):8000"},
            {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "model"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
        ],
    }
    env = container_env(
        POD,
        container,
        "127.1.0.2",
        "127.0.0.1",
        lambda ns, n: {"model": "tiny"} if (ns, n) == ("team-a", "cfg") else None,
        lambda ns, n: {"token": "s3cret"} if n == "sec" else None,
    )
    assert env == {
        "POD_IP": "127.1.0.2",
        "NS": "team-a",
        "APP": "web",
        "URL": "http://127.1.0.2:8000",
        "MODEL": "tiny",
        "KEY": "s3cret",
    }


def test_missing_config_map_key_names_it():
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}}],
    }
    with pytest.raises(EnvError, match="configmap team-a/cfg has no key 'k'"):
        container_env(POD, container, "127.1.0.2", "127.0.0.1", no_lookup, no_lookup)


def test_optional_reference_may_be_missing():
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}}],
    }
    assert container_env(POD, container, "127.1.0.2", "127.0.0.1", no_lookup, no_lookup) == {}


def test_resource_field_ref():
    container = {
        "name": "c",
        "resources": {"limits": {"cpu": "1500m", "memory": "2Gi"}},
        "env": [
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
        ],
    }
    env = container_env(POD, container, "127.1.0.2", "127.0.0.1", no_lookup, no_lookup)
    assert env == {"CPU": "2", "MEM": "2048"}


def test_argv_expands_and_requires_a_command():
    container = {"name": "c", "command": ["serve"], "args": ["--host", "$(POD_IP)"]}
    assert container_argv(container, {"POD_IP": "127.1.0.9"}) == ["serve", "--host", "127.1.0.9"]
    with pytest.raises(EnvError, match="images are never pulled"):
        container_argv({"name": "c", "image": "nginx"}, {})


SCRIPTS = "/opt/venv/bin"


def test_pod_path_puts_the_scripts_dir_first():
    assert pod_path("/usr/bin:/bin", SCRIPTS) == "/opt/venv/bin:/usr/bin:/bin"


def test_pod_path_does_not_duplicate_the_scripts_dir():
    assert pod_path("/usr/bin:/opt/venv/bin/:/bin", SCRIPTS) == "/opt/venv/bin:/usr/bin:/bin"
    assert pod_path("/opt/venv/bin:/usr/bin", SCRIPTS) == "/opt/venv/bin:/usr/bin"


def test_pod_path_without_an_inherited_path_keeps_the_system_default():
    assert pod_path(None, SCRIPTS) == os.pathsep.join([SCRIPTS, *filter(None, os.defpath.split(":"))])
    assert pod_path("", SCRIPTS) == SCRIPTS  # an empty entry would mean the pod's working folder


def test_base_env_keeps_only_the_passed_on_keys_and_fixes_path():
    environ = {"PATH": "/usr/bin", "HOME": "/root", "SECRET_TOKEN": "x"}
    assert base_env(environ, SCRIPTS) == {"PATH": "/opt/venv/bin:/usr/bin", "HOME": "/root"}
