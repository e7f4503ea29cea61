"""A small Kubernetes REST client for the node agent: JSON in, dicts out, streaming watches.

The agent needs a handful of verbs on a few resources and must survive hundreds of pods in
--simulate mode, so it talks plain REST over one pooled HTTP/1.1 connection set.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str, method: str, path: str):
        self.status = status
        try:
            self.reason = json.loads(body).get("reason", "")
            message = json.loads(body).get("message", body)
        except ValueError:
            self.reason, message = "", body
        super().__init__(f"{method} {path}: {status} {message}")


def _materialize(entry: dict, key: str, folder: Path) -> str | None:
    """kubeconfig fields come as a path or as base64 `-data`; httpx wants paths."""
    if entry.get(key):
        return entry[key]
    data = entry.get(f"{key}-data")
    if not data:
        return None
    path = folder / key
    path.write_bytes(base64.b64decode(data))
    return str(path)


def tls_context(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """httpx takes client certificates only through an SSLContext."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


class KubeClient:
    def __init__(self, kubeconfig: Path, timeout: float = 30.0):
        config = yaml.safe_load(Path(kubeconfig).read_text())
        context_name = config.get("current-context")
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        self._tmp = tempfile.TemporaryDirectory(prefix="flotilla-kube-")
        folder = Path(self._tmp.name)
        ca = _materialize(cluster, "certificate-authority", folder)
        cert = _materialize(user, "client-certificate", folder)
        key = _materialize(user, "client-key", folder)
        headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        self.server = cluster["server"]
        self.http = httpx.Client(
            base_url=self.server,
            verify=tls_context(ca, cert, key),
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )

    def close(self) -> None:
        self.http.close()
        self._tmp.cleanup()

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        params: dict | None = None,
        content_type: str = "application/json",
    ) -> dict:
        content = json.dumps(body).encode() if body is not None else None
        response = self.http.request(
            method,
            path,
            content=content,
            params=params,
            headers={"Content-Type": content_type} if content else None,
        )
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text, method, path)
        return response.json() if response.content else {}

    def get(self, path: str, params: dict | None = None) -> dict:
        return self.request("GET", path, params=params)

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    def delete(self, path: str, body: dict | None = None) -> dict:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 300) -> Iterator[dict]:
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        with self.http.stream(
            "GET", path, params=params, timeout=httpx.Timeout(timeout_seconds + 30)
        ) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, response.read().decode(), "WATCH", path)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)
