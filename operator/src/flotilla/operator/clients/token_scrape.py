"""Tokens served, read from each engine pod's GET /metrics (prompt and generation token counters)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flotilla.operator.api.v1alpha1 import TokenCount
from flotilla.operator.config import ENGINE_PORT
from flotilla.operator.naming import SERVICE_LABEL

PROMPT, GENERATION = "flotilla_prompt_tokens_total", "flotilla_generation_tokens_total"


def parse_tokens(text: str) -> TokenCount | None:
    """The counters summed over label sets; None when the engine exports neither."""
    found, counts = False, {PROMPT: 0.0, GENERATION: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counts:
                counts[sample.name] += sample.value
                found = True
    return TokenCount(input=int(counts[PROMPT]), output=int(counts[GENERATION])) if found else None


def read_token_counters(pods: list[dict], timeout: float = 1.0) -> dict[str, TokenCount]:
    """Pod uid -> counters, for the engine pods that are Ready and answer; others are skipped."""
    out = {}
    with httpx.Client(timeout=timeout, trust_env=False) as http:
        for pod in pods:
            meta, status = pod["metadata"], pod["status"]
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            if not (ready and status.get("podIP") and SERVICE_LABEL in (meta.get("labels") or {})):
                continue
            try:
                rsp = http.get(f"http://{status['podIP']}:{ENGINE_PORT}/metrics")
                rsp.raise_for_status()
                counts = parse_tokens(rsp.text)
            except (httpx.HTTPError, ValueError):
                continue
            if counts is not None:
                out[meta["uid"]] = counts
    return out
