"""The gateway's Kubernetes I/O: list-then-watch of a collection, and one merge patch (the demand annotation).

Plain httpx against the API server, so the gateway carries no Kubernetes client library: in a pod it uses
its ServiceAccount's token and CA; elsewhere a kubeconfig with a token or a client certificate. A watch
that ends or fails relists (a 410 Gone means the resourceVersion is too old), with a capped backoff.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

log = logging.getLogger("flotilla.gateway.kube")

IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE = "application/merge-patch+json"

# (type, object): "ADDED" | "MODIFIED" | "DELETED"; "SYNCED" with the full list after each (re)list.
WatchEvent = tuple[str, dict]


@dataclass
class ApiConfig:
    server: str
    ssl_context: ssl.SSLContext | bool
    token_file: Path | None = None
    token: str | None = None

    def headers(self) -> dict[str, str]:
        token = self.token_file.read_text().strip() if self.token_file else self.token  # bound tokens rotate
        return {"Authorization": f"Bearer {token}"} if token else {}


def load_config(kubeconfig: Path | None) -> ApiConfig:
    """In-cluster when no kubeconfig is given and the ServiceAccount files exist, else the kubeconfig."""
    if kubeconfig is None and (IN_CLUSTER / "token").exists():
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host
        context = ssl.create_default_context(cafile=str(IN_CLUSTER / "ca.crt"))
        return ApiConfig(f"https://{host}:{port}", context, token_file=IN_CLUSTER / "token")
    path = kubeconfig or Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
    data = yaml.safe_load(path.read_text())
    context_name = data.get("current-context")
    context = next(c["context"] for c in data["contexts"] if c["name"] == context_name)
    cluster = next(c["cluster"] for c in data["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in data["users"] if u["name"] == context["user"])
    base = path.parent
    if cluster.get("insecure-skip-tls-verify"):
        ssl_context: ssl.SSLContext | bool = False
    else:
        ssl_context = ssl.create_default_context(
            cafile=_file(cluster, "certificate-authority", base),
            cadata=_data(cluster, "certificate-authority"),
        )
    if isinstance(ssl_context, ssl.SSLContext) and (
        user.get("client-certificate") or user.get("client-certificate-data")
    ):
        cert, key = _as_file(user, "client-certificate", base), _as_file(user, "client-key", base)
        ssl_context.load_cert_chain(cert, key)
    return ApiConfig(cluster["server"], ssl_context, token=user.get("token"))


def _file(entry: dict, name: str, base: Path) -> str | None:
    value = entry.get(name)
    return str(base / value) if value else None


def _data(entry: dict, name: str) -> str | None:
    value = entry.get(f"{name}-data")
    return base64.b64decode(value).decode() if value else None


def _as_file(entry: dict, name: str, base: Path) -> str:
    """ssl wants certificate files: inline data goes to a private temporary file."""
    path = _file(entry, name, base)
    if path:
        return path
    with tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False) as handle:  # created 0600
        handle.write(_data(entry, name) or "")
    return handle.name


class Kube:
    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(base_url=config.server, verify=config.ssl_context, timeout=30)

    async def close(self) -> None:
        await self.client.aclose()

    async def list(self, path: str, params: dict | None = None) -> dict:
        rsp = await self.client.get(path, params=params, headers=self.config.headers())
        rsp.raise_for_status()
        return rsp.json()

    async def merge_patch(self, path: str, patch: dict) -> None:
        headers = self.config.headers() | {"Content-Type": MERGE}
        rsp = await self.client.patch(path, content=json.dumps(patch), headers=headers)
        rsp.raise_for_status()

    async def watch(
        self, path: str, on_event: Callable[[WatchEvent], Awaitable[None] | None], params: dict | None = None
    ) -> None:
        """Forever: list (reported as one SYNCED event with every item), then watch from the list's
        resourceVersion; relist when the watch ends, expires or fails."""
        backoff = 0.5
        while True:
            try:
                listed = await self.list(path, params)
                await _call(on_event, ("SYNCED", {"items": listed.get("items") or []}))
                version = listed["metadata"]["resourceVersion"]
                backoff = 0.5
                query = dict(params or {}) | {"watch": "1", "resourceVersion": version,
                                               "allowWatchBookmarks": "true", "timeoutSeconds": "300"}  # fmt: skip
                async with self.client.stream(
                    "GET",
                    path,
                    params=query,
                    headers=self.config.headers(),
                    timeout=httpx.Timeout(30, read=330),
                ) as rsp:
                    rsp.raise_for_status()
                    async for line in rsp.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":  # 410 Gone: the version expired; relist
                            break
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            await _call(on_event, (kind, obj))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server restarting, a network blip: relist after a pause
                log.warning("watch %s failed (%s); relisting in %.1fs", path, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)


async def _call(callback: Callable[[WatchEvent], Awaitable[None] | None], event: WatchEvent) -> None:
    result = callback(event)
    if result is not None:
        await result
