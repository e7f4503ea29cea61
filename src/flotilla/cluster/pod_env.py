"""A container's environment and command line, resolved the way the kubelet does it.

Pure functions: the ConfigMap and Secret lookups are passed in, so this unit-tests without a cluster.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Callable, Mapping
from fractions import Fraction

from flotilla.quantity import parse_quantity

# (namespace, name) -> the object's data (ConfigMap) or decoded data (Secret); None when absent.
Lookup = Callable[[str, str], dict[str, str] | None]

# What a pod process inherits from the node agent; the container's own env is laid over it.
BASE_ENV_KEYS = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "VIRTUAL_ENV",
    "XDG_CACHE_HOME",
    "TRITON_INTERPRET",
)


class EnvError(ValueError):
    """A reference that cannot be resolved; the pod waits with reason CreateContainerConfigError."""


def secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise EnvError(f"fieldRef {path!r} is not supported by the node agent")


def resource_ref(container: dict, ref: dict) -> str:
    """A resourceFieldRef's value: the container's request or limit over the divisor, rounded up (as the
    kubelet does); a value that is not a quantity is passed as written."""
    kind, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    if value is None:
        return "0"
    try:
        amount = parse_quantity(value)
    except ValueError:
        return str(value)
    try:
        divisor = parse_quantity(ref.get("divisor", "1"))
    except ValueError:
        divisor = Fraction(1)
    return str(math.ceil(amount / divisor))


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: unknown references stay as written, $$ escapes a dollar."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        value = env.get(name)
        return match.group(0) if value is None else value

    return _VAR.sub(replace, text)


def container_env(
    pod: dict,
    container: dict,
    pod_ip: str,
    host_ip: str,
    config_maps: Lookup,
    secrets: Lookup,
    services: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """services: the KUBERNETES_SERVICE_* variables; like the kubelet's they come first, so the
    container's own env overrides them and $(KUBERNETES_SERVICE_HOST) expands."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = dict(services or {})
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, lookup in (("configMapRef", config_maps), ("secretRef", secrets)):
            ref = source.get(kind)
            if not ref:
                continue
            data = lookup(namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise EnvError(f"{kind.removesuffix('Ref')} {namespace}/{ref['name']} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(item.get("value", ""), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            env[name] = resource_ref(container, source["resourceFieldRef"])
        else:
            kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
            ref = source[kind]
            data = (config_maps if kind == "configMapKeyRef" else secrets)(namespace, ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                what = "configmap" if kind == "configMapKeyRef" else "secret"
                raise EnvError(f"{what} {namespace}/{ref['name']} has no key {ref['key']!r} (env {name})")
            env[name] = data[ref["key"]]
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    command = container.get("command") or []
    if not command:
        raise EnvError(
            f"container {container['name']!r} has no command: images are never pulled in the local cluster, "
            "so the container must name a command that exists on this host"
        )
    return [expand(part, env) for part in [*command, *(container.get("args") or [])]]


def pod_path(inherited: str | None, scripts_dir: str) -> str:
    """The PATH pods get: `scripts_dir` first, then the inherited entries without it.

    The operator's pods run `flotilla ...`, which must resolve to this installation even when the cluster
    was started as `.venv/bin/flotilla cluster up` without activating the virtual environment (so the
    inherited PATH lacks it). Empty entries are dropped because they would mean the pod's working folder.
    """
    entries = (os.defpath if inherited is None else inherited).split(os.pathsep)
    first = os.path.normpath(scripts_dir)
    rest = [entry for entry in entries if entry and os.path.normpath(entry) != first]
    return os.pathsep.join([scripts_dir, *rest])


def base_env(environ: Mapping[str, str], scripts_dir: str) -> dict[str, str]:
    """The environment every pod process starts from, before its container's env."""
    env = {key: environ[key] for key in BASE_ENV_KEYS if key in environ}
    env["PATH"] = pod_path(environ.get("PATH"), scripts_dir)
    return env
