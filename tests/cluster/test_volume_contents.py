"""configMap, secret, downwardAPI and projected volume files, computed without a cluster."""

import base64

import pytest

from flotilla.cluster.service_account import api_access_volume
from flotilla.cluster.volume_contents import Sources, VolumeError, volume_files

POD = {
    "metadata": {"name": "web-1", "namespace": "team-a", "uid": "u-1", "labels": {"app": "web", "tier": "x"}},
    "spec": {"containers": [{"name": "main", "resources": {"limits": {"memory": "2Gi"}}}]},
}
CONFIG = {
    "data": {"model": "tiny", "ca.crt": "PEM"},
    "binaryData": {"blob": base64.b64encode(b"\x00\x01").decode()},
}
SECRET = {"data": {"token": base64.b64encode(b"s3cret").decode()}}


def _sources(tokens: list | None = None) -> Sources:
    objects = {("team-a", "cfg"): CONFIG, ("team-a", "kube-root-ca.crt"): CONFIG, ("team-a", "sec"): SECRET}

    def token(source: dict) -> str:
        if tokens is not None:
            tokens.append(source)
        return "jwt"

    return Sources(
        config_map=lambda ns, name: objects.get((ns, name)) if name != "sec" else None,
        secret=lambda ns, name: objects.get((ns, name)) if name == "sec" else None,
        token=token,
        pod_ip="127.7.0.2",
        host_ip="127.0.0.1",
    )


def test_config_map_all_keys_with_default_mode():
    files = volume_files({"name": "v", "configMap": {"name": "cfg"}}, POD, _sources())
    assert files == {"model": (b"tiny", 0o644), "ca.crt": (b"PEM", 0o644), "blob": (b"\x00\x01", 0o644)}


def test_items_map_keys_to_paths_with_modes():
    volume = {
        "name": "v",
        "configMap": {
            "name": "cfg",
            "defaultMode": 0o600,
            "items": [
                {"key": "model", "path": "conf/model.txt"},
                {"key": "ca.crt", "path": "ca", "mode": 0o400},
            ],
        },
    }
    assert volume_files(volume, POD, _sources()) == {
        "conf/model.txt": (b"tiny", 0o600),
        "ca": (b"PEM", 0o400),
    }


def test_secret_is_decoded():
    files = volume_files({"name": "v", "secret": {"secretName": "sec"}}, POD, _sources())
    assert files == {"token": (b"s3cret", 0o644)}


def test_missing_objects_and_keys_wait_unless_optional():
    with pytest.raises(VolumeError, match="not found"):
        volume_files({"name": "v", "configMap": {"name": "absent"}}, POD, _sources())
    assert (
        volume_files({"name": "v", "configMap": {"name": "absent", "optional": True}}, POD, _sources()) == {}
    )
    missing_key = {"name": "cfg", "items": [{"key": "nope", "path": "x"}]}
    with pytest.raises(VolumeError, match="no key 'nope'"):
        volume_files({"name": "v", "configMap": missing_key}, POD, _sources())


def test_paths_may_not_leave_the_volume():
    escape = {"name": "cfg", "items": [{"key": "model", "path": "../etc/passwd"}]}
    with pytest.raises(VolumeError, match="inside the volume"):
        volume_files({"name": "v", "configMap": escape}, POD, _sources())


def test_downward_api_fields_label_maps_and_resources():
    volume = {
        "name": "v",
        "downwardAPI": {
            "items": [
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "ip", "fieldRef": {"fieldPath": "status.podIP"}},
                {
                    "path": "mem",
                    "resourceFieldRef": {
                        "containerName": "main",
                        "resource": "limits.memory",
                        "divisor": "1Mi",
                    },
                },
            ]
        },
    }
    files = volume_files(volume, POD, _sources())
    assert files == {
        "name": (b"web-1", 0o644),
        "labels": (b'app="web"\ntier="x"', 0o644),
        "ip": (b"127.7.0.2", 0o644),
        "mem": (b"2048", 0o644),
    }


def test_the_service_account_volume_holds_token_ca_and_namespace():
    requested: list = []
    files = volume_files(api_access_volume(), POD, _sources(requested))
    assert files == {"token": (b"jwt", 0o644), "ca.crt": (b"PEM", 0o644), "namespace": (b"team-a", 0o644)}
    assert requested == [{"expirationSeconds": 3607, "path": "token"}]


def test_a_refused_token_is_a_volume_error():
    def refuse(_source):
        raise RuntimeError("403 forbidden")

    sources = Sources(lambda *_: CONFIG, lambda *_: None, refuse)
    with pytest.raises(VolumeError, match="403 forbidden"):
        volume_files(api_access_volume(), POD, sources)


def test_other_volume_types_are_not_projections():
    assert volume_files({"name": "v", "emptyDir": {}}, POD, _sources()) is None
