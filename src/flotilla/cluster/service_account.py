"""What a pod needs to reach the API server from inside: the KUBERNETES_SERVICE_* environment, the
ServiceAccount volume (when admission did not add it) and projected tokens from the TokenRequest API.

The pure parts (env, the implicit volume, the request body, when to refresh) take plain dicts; TokenSource
does the one API call and caches tokens until 80% of their lifetime has passed, as the kubelet does.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from flotilla.timestamps import parse_time

DEFAULT_SERVICEACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
IMPLICIT_VOLUME = "kube-api-access-flotilla"
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"  # published in every namespace by the controller-manager
DEFAULT_EXPIRATION_SECONDS = 3607  # what the ServiceAccount admission plugin asks for
REFRESH_FRACTION = 0.8  # the kubelet renews a projected token once 80% of its lifetime has passed


def api_endpoint(server_url: str) -> tuple[str, int]:
    """(host, port) of the API server from a kubeconfig's `server`: what pods dial directly, because the
    `kubernetes` Service's ClusterIP is only allocated, never routed, in the local cluster."""
    parts = urlsplit(server_url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def service_env(host: str, port: int) -> dict[str, str]:
    """The `kubernetes` Service's variables as the kubelet sets them, pointing at the real API server.

    The serving certificate covers 127.0.0.1 (pki.API_SERVER_IPS), so TLS to this host verifies against
    the cluster CA in the mounted ca.crt."""
    tcp = f"tcp://{host}:{port}"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": tcp,
        f"KUBERNETES_PORT_{port}_TCP": tcp,
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


def service_account_name(pod: dict) -> str:
    spec = pod.get("spec") or {}
    return spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"


def api_access_volume(name: str = IMPLICIT_VOLUME) -> dict:
    """The projected volume the ServiceAccount admission plugin adds: token, cluster CA, namespace."""
    return {
        "name": name,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": DEFAULT_EXPIRATION_SECONDS, "path": "token"}},
                {"configMap": {"name": ROOT_CA_CONFIG_MAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
        },
    }


def wants_token(pod: dict, service_account: Callable[[], dict | None]) -> bool:
    """automountServiceAccountToken: the pod's setting wins, then the ServiceAccount's, else true.

    service_account is called only when the pod leaves it open; a missing ServiceAccount means no token
    (TokenRequest would fail for it anyway)."""
    pod_setting = (pod.get("spec") or {}).get("automountServiceAccountToken")
    if pod_setting is not None:
        return bool(pod_setting)
    account = service_account()
    if account is None:
        return False
    return account.get("automountServiceAccountToken") is not False


def with_api_access(pod: dict, service_account: Callable[[], dict | None]) -> dict:
    """The pod spec with the ServiceAccount volume added where the API server's admission did not add it.

    On this cluster the ServiceAccount admission plugin normally adds a `kube-api-access-*` volume and its
    mounts itself, and the agent only stages it like any projected volume. This covers pods admitted
    without it (the plugin off, or pods made before it ran), unless automount is off. Returns a new dict;
    the input is not changed."""
    spec = pod.get("spec") or {}
    groups = ("initContainers", "containers")
    lacking = [
        (group, i)
        for group in groups
        for i, container in enumerate(spec.get(group) or [])
        if not any(
            m.get("mountPath", "").rstrip("/") == DEFAULT_SERVICEACCOUNT_PATH
            for m in container.get("volumeMounts") or []
        )
    ]
    if not lacking or not wants_token(pod, service_account):
        return pod
    new_spec = {**spec, "volumes": [*(spec.get("volumes") or []), api_access_volume()]}
    for group in groups:
        if spec.get(group):
            new_spec[group] = [dict(c) for c in spec[group]]
    mount = {"name": IMPLICIT_VOLUME, "mountPath": DEFAULT_SERVICEACCOUNT_PATH, "readOnly": True}
    for group, i in lacking:
        container = new_spec[group][i]
        container["volumeMounts"] = [*(container.get("volumeMounts") or []), mount]
    return {**pod, "spec": new_spec}


def token_request(pod: dict, audience: str | None, expiration_seconds: int) -> dict:
    """A TokenRequest bound to the pod, so the token dies with it (boundObjectRef kind Pod, name, uid)."""
    meta = pod["metadata"]
    spec: dict = {
        "expirationSeconds": expiration_seconds,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
    }
    if audience:
        spec["audiences"] = [audience]
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}


def refresh_at(issued: dt.datetime, expires: dt.datetime) -> dt.datetime:
    return issued + (expires - issued) * REFRESH_FRACTION


@dataclass
class _Token:
    value: str
    refresh_at: dt.datetime


class TokenSource:
    """One pod's projected tokens, requested through `post` (path, body) -> response and cached per
    (audience, expirationSeconds) until they are due for renewal."""

    def __init__(self, pod: dict, post: Callable[[str, dict], dict], clock=lambda: dt.datetime.now(dt.UTC)):
        self.pod, self.post, self.clock = pod, post, clock
        self._tokens: dict[tuple[str, int], _Token] = {}
        self._lock = threading.Lock()

    def token(self, source: dict) -> str:
        audience = source.get("audience") or ""
        seconds = int(source.get("expirationSeconds") or 3600)
        key = (audience, seconds)
        with self._lock:
            cached = self._tokens.get(key)
            now = self.clock()
            if cached is not None and now < cached.refresh_at:
                return cached.value
            meta = self.pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{service_account_name(self.pod)}/token"
            status = self.post(path, token_request(self.pod, audience or None, seconds)).get("status") or {}
            expires = parse_time(status["expirationTimestamp"]) if status.get("expirationTimestamp") else None
            due = (
                refresh_at(now, expires)
                if expires
                else now + dt.timedelta(seconds=seconds * REFRESH_FRACTION)
            )
            self._tokens[key] = _Token(status["token"], due)
            return status["token"]
