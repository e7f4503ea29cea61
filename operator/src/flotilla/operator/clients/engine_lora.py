"""An engine pod's LoRA adapter API (docs/lora.md): GET /v1/models, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, by pod IP (as engine_metrics.py scrapes: the figures are per replica).

Each call answers (status code, body text); 0 with the error's text when the engine did not answer. The
decisions on those answers are desired/lora_adapter.py's. An engine that has an internal token (the
namespace's, engine_token) loads and unloads adapters only for callers that send it, so the calls carry it
when the operator has the master; listing needs none.
"""

from __future__ import annotations

import json

import httpx

from flotilla.contract import HEADER_INTERNAL_TOKEN

LIST_TIMEOUT = 5.0
# Loading reads and checks the adapter's whole folder before it answers; an hf:// or http(s) source's first
# load also downloads it. A load that outlasts this stays Loading: the engine finishes the fetch into its
# cache regardless, and a later round's load finds it there.
LOAD_TIMEOUT = 60.0


def _call(
    method: str, url: str, timeout: float, body: dict | None = None, token: str | None = None
) -> tuple[int, str]:
    headers = {HEADER_INTERNAL_TOKEN: token} if token else {}
    try:
        rsp = httpx.request(method, url, json=body, timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    return rsp.status_code, rsp.text


def list_models(base_url: str) -> tuple[int, dict | None]:
    """GET {base_url}/models (base_url: the OpenAI base, http://ip:port/v1): the listing, or None."""
    code, text = _call("GET", f"{base_url}/models", LIST_TIMEOUT)
    if code != 200:
        return code, None
    try:
        listing = json.loads(text)
    except ValueError:
        return code, None
    return code, listing if isinstance(listing, dict) else None


def load(base_url: str, name: str, path: str, token: str | None = None) -> tuple[int, str]:
    body = {"lora_name": name, "lora_path": path}
    return _call("POST", f"{base_url}/load_lora_adapter", LOAD_TIMEOUT, body, token)


def unload(base_url: str, name: str, token: str | None = None) -> tuple[int, str]:
    return _call("POST", f"{base_url}/unload_lora_adapter", LIST_TIMEOUT, {"lora_name": name}, token)
