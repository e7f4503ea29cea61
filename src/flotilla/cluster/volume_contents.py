"""The files of configMap, secret, downwardAPI and projected volumes, computed the way the kubelet does.

Pure: objects are fetched through the lookups in Sources and tokens through its `token` callable, so
every rule here (items, key -> path, optional, defaultMode and per-item mode) unit-tests without a cluster.
A volume's files are a dict of relative path -> (content, mode).
"""

from __future__ import annotations

import base64
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from flotilla.cluster.pod_env import EnvError, field_ref, resource_ref

DEFAULT_MODE = 0o644  # the API server's default for defaultMode (420)

Files = dict[str, tuple[bytes, int]]
Getter = Callable[[str, str], dict | None]  # (namespace, name) -> the raw object, None when absent


class VolumeError(RuntimeError):
    """A volume that cannot be set up yet (a missing ConfigMap, a refused token): the kubelet's
    FailedMount. The pod's containers wait in ContainerCreating with this message and the agent retries."""


@dataclass(frozen=True)
class Sources:
    config_map: Getter
    secret: Getter
    token: Callable[[dict], str]  # a serviceAccountToken projection -> the token
    pod_ip: str = ""
    host_ip: str = ""


def config_map_bytes(obj: dict) -> dict[str, bytes]:
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def secret_bytes(obj: dict) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
    return data


def _safe(path: str) -> str:
    """A relative path that stays inside the volume (the API server checks this too)."""
    norm = posixpath.normpath(path)
    if not path or norm.startswith(("/", "..")) or norm == ".":
        raise VolumeError(f"volume item path {path!r} must be relative and stay inside the volume")
    return norm


def _keys(data: dict[str, bytes], items: list[dict] | None, mode: int, what: str, optional: bool) -> Files:
    if not items:
        return {_safe(key): (value, mode) for key, value in data.items()}
    files: Files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"{what} has no key {item['key']!r}")
        files[_safe(item["path"])] = (data[item["key"]], item.get("mode", mode))
    return files


def _object_files(kind: str, name: str, source: dict, namespace: str, get: Getter, mode: int) -> Files:
    obj = get(namespace, name)
    optional = bool(source.get("optional"))
    what = f"{kind} {namespace}/{name}"
    if obj is None:
        if optional:
            return {}
        raise VolumeError(f"{what} not found")
    data = config_map_bytes(obj) if kind == "configmap" else secret_bytes(obj)
    return _keys(data, source.get("items"), mode, what, optional)


def _map_text(values: dict[str, str]) -> str:
    """metadata.labels / metadata.annotations as a whole: `key="value"` lines, sorted, like the kubelet."""
    return "\n".join(f"{key}={json.dumps(values[key])}" for key in sorted(values))


def downward_files(source: dict, pod: dict, sources: Sources, mode: int) -> Files:
    files: Files = {}
    meta = pod.get("metadata") or {}
    for item in source.get("items") or []:
        item_mode = item.get("mode", mode)
        if "fieldRef" in item:
            path = item["fieldRef"]["fieldPath"]
            if path in ("metadata.labels", "metadata.annotations"):
                value = _map_text(meta.get(path.split(".")[1]) or {})
            else:
                try:
                    value = field_ref(pod, path, sources.pod_ip, sources.host_ip)
                except EnvError as exc:
                    raise VolumeError(str(exc)) from exc
        else:
            ref = item["resourceFieldRef"]
            containers = (pod.get("spec") or {}).get("containers") or []
            container = next((c for c in containers if c["name"] == ref.get("containerName")), None)
            if container is None:
                raise VolumeError(f"downwardAPI item {item['path']!r} names no container of this pod")
            value = resource_ref(container, ref)
        files[_safe(item["path"])] = (value.encode(), item_mode)
    return files


def projected_files(projected: dict, pod: dict, sources: Sources) -> Files:
    namespace = pod["metadata"]["namespace"]
    mode = projected.get("defaultMode", DEFAULT_MODE)
    files: Files = {}
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            token_source = source["serviceAccountToken"]
            try:
                token = sources.token(token_source)
            except Exception as exc:  # the API's refusal, worded for the waiting message
                raise VolumeError(f"service account token: {exc}") from exc
            files[_safe(token_source["path"])] = (token.encode(), mode)
        elif "configMap" in source:
            ref = source["configMap"]
            files.update(_object_files("configmap", ref["name"], ref, namespace, sources.config_map, mode))
        elif "secret" in source:
            ref = source["secret"]
            files.update(_object_files("secret", ref["name"], ref, namespace, sources.secret, mode))
        elif "downwardAPI" in source:
            files.update(downward_files(source["downwardAPI"], pod, sources, mode))
        # clusterTrustBundle and podCertificate sources are not supported; they add no files.
    return files


def volume_files(volume: dict, pod: dict, sources: Sources) -> Files | None:
    """The files of a projection-type volume, or None for a volume of another type."""
    namespace = pod["metadata"]["namespace"]
    if "configMap" in volume:
        ref = volume["configMap"]
        mode = ref.get("defaultMode", DEFAULT_MODE)
        return _object_files("configmap", ref["name"], ref, namespace, sources.config_map, mode)
    if "secret" in volume:
        ref = volume["secret"]
        mode = ref.get("defaultMode", DEFAULT_MODE)
        return _object_files("secret", ref["secretName"], ref, namespace, sources.secret, mode)
    if "downwardAPI" in volume:
        ref = volume["downwardAPI"]
        return downward_files(ref, pod, sources, ref.get("defaultMode", DEFAULT_MODE))
    if "projected" in volume:
        return projected_files(volume["projected"], pod, sources)
    return None
