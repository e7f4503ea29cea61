"""Tokens served, read from each engine pod's GET /metrics (prompt and generation token counters, in all
and per LoRA adapter)."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from flotilla.operator.api.conditions import is_ready
from flotilla.operator.api.v1alpha1 import TokenCount
from flotilla.operator.clients.engine_metrics import ScrapeError, metrics_url, parse_engine_metrics
from flotilla.operator.naming import SERVICE_LABEL


@dataclass(frozen=True)
class PodTokens:
    total: TokenCount
    adapters: dict[str, TokenCount] = field(default_factory=dict)  # LoRA adapter name -> its counters


def parse_tokens(text: str) -> PodTokens | None:
    """The token counters of one engine's /metrics; None when the engine exports neither."""
    sample = parse_engine_metrics(text)
    if sample.prompt_tokens is None and sample.generation_tokens is None:
        return None
    names = sorted({*sample.lora_prompt_tokens, *sample.lora_generation_tokens})
    adapters = {
        n: TokenCount(
            input=int(sample.lora_prompt_tokens.get(n, 0)),
            output=int(sample.lora_generation_tokens.get(n, 0)),
        )
        for n in names
    }
    total = TokenCount(input=int(sample.prompt_tokens or 0), output=int(sample.generation_tokens or 0))
    return PodTokens(total=total, adapters=adapters)


def read_token_counters(pods: list[dict], timeout: float = 1.0) -> dict[str, PodTokens]:
    """Pod uid -> counters, for the engine pods that are Ready and answer; others are skipped."""
    out = {}
    with httpx.Client(timeout=timeout, trust_env=False) as http:
        for pod in pods:
            meta, status = pod["metadata"], pod["status"]
            if not (is_ready(pod) and status.get("podIP") and SERVICE_LABEL in (meta.get("labels") or {})):
                continue
            try:
                rsp = http.get(metrics_url(status["podIP"]))
                rsp.raise_for_status()
                counts = parse_tokens(rsp.text)
            except (httpx.HTTPError, ScrapeError):
                continue
            if counts is not None:
                out[meta["uid"]] = counts
    return out
