"""The arithmetic of the comparisons with vLLM (`bench offline|serve --compare vllm`): round orders, ratios
per round and their median, greedy agreement, and one set of latency figures from either client. Pure:
no processes, no torch.

A ratio is always Flotilla's figure over vLLM's, so above 1 Flotilla is faster for a rate (tok/s) and
slower for a latency (TTFT, TPOT, ITL, start-up)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SYSTEMS: tuple[str, str] = ("flotilla", "vllm")
# The latency figures either client reports, as (key, what it is); all in seconds.
LATENCIES = (
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p95_s", "TTFT p95"),
    ("tpot_p50_s", "TPOT p50"),
    ("tpot_p95_s", "TPOT p95"),
    ("itl_p50_s", "ITL p50"),
    ("itl_p95_s", "ITL p95"),
)
# The targets of issue #27 for the figures that have one (a rate at least, a latency at most).
TARGETS = {"output_tok_s": (">=", 1.25), "ttft_p95_s": ("<=", 0.8), "tpot_p50_s": ("<=", 0.8)}


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which system runs first in each round: alternating, so that drift in the machine's speed over the
    run falls on both."""
    if rounds < 1:
        raise ValueError(f"--rounds must be 1 or more, got {rounds}")
    first, second = SYSTEMS
    return [(first, second) if r % 2 == 0 else (second, first) for r in range(rounds)]


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not math.isfinite(ours) or not math.isfinite(theirs) or theirs == 0:
        return None
    return ours / theirs


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def ratios(ours: Sequence[float | None], theirs: Sequence[float | None]) -> dict[str, Any]:
    """Per round Flotilla/vLLM, and the median of those ratios (not the ratio of medians: a round's two
    runs are adjacent in time, so its ratio is the one the machine's drift disturbs least)."""
    per_round = [ratio(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {"per_round": per_round, "median": median(per_round)}


def verdict(key: str, value: float | None) -> str | None:
    """Whether a median ratio meets issue #27's target for it: 'met', 'missed', or None (no target)."""
    if key not in TARGETS or value is None:
        return None
    op, bound = TARGETS[key]
    return "met" if (value >= bound if op == ">=" else value <= bound) else "missed"


def greedy_agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How alike the two systems' greedy outputs are, request by request: how many are identical, and the
    mean share of each output before its first difference."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs against {len(theirs)}")
    shares, first_differences = [], []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        longest = max(len(a), len(b))
        shares.append(same / longest if longest else 1.0)
        if same < longest:
            first_differences.append(same)
    return {
        "requests": len(ours),
        "identical": len(ours) - len(first_differences),
        "mean_matching_prefix_share": statistics.fmean(shares) if shares else 1.0,
        "first_differences": first_differences,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks, as numpy's default (and so
    `vllm bench serve`) computes it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def client_figures(
    *,
    completed: int,
    failed: int,
    duration_s: float,
    output_tokens: int,
    ttfts: Sequence[float],
    tpots: Sequence[float],
    itls: Sequence[float],
) -> dict[str, Any]:
    """One client's run against one server, in the comparison's terms."""
    figures: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration_s if duration_s > 0 else None,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        for q in (50, 95):
            figures[f"{name}_p{q}_s"] = percentile(values, q)
    return figures


def vllm_client_figures(result: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm bench serve`'s result JSON (run with --metric-percentiles 50,95) in the comparison's terms."""
    figures: dict[str, Any] = {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "duration_s": result["duration"],
        "output_tokens": result["total_output_tokens"],
        "output_tok_s": result["output_throughput"],
    }
    for name in ("ttft", "tpot", "itl"):
        for q in (50, 95):
            value = result.get(f"p{q}_{name}_ms")
            figures[f"{name}_p{q}_s"] = value / 1000 if value is not None else None
    return figures


def flotilla_client_figures(summary: Mapping[str, Any], results: Sequence[Any]) -> dict[str, Any]:
    """`flotilla engine bench serve`'s summary and per-request results in the comparison's terms."""
    good = [r for r in results if r.ok]
    return client_figures(
        completed=summary["completed"],
        failed=summary["failed"],
        duration_s=summary["duration_s"],
        output_tokens=summary["total_output_tokens"],
        ttfts=[r.ttft for r in good if r.ttft is not None],
        tpots=[r.tpot for r in good if r.tpot is not None],
        itls=[gap for r in good for gap in r.itl],
    )


def serve_ratios(rounds: Sequence[Mapping[str, Any]], client: str) -> dict[str, dict[str, Any]]:
    """For one client: each figure's Flotilla/vLLM ratio per round and its median, with the verdict
    against the issue's target where there is one. Start-up is the servers' own, the same for both
    clients."""
    keys = ["output_tok_s"] + [key for key, _ in LATENCIES]
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        figures = {s: [r[s]["clients"][client][key] for r in rounds] for s in SYSTEMS}
        out[key] = ratios(figures["flotilla"], figures["vllm"])
        out[key]["verdict"] = verdict(key, out[key]["median"])
    return out


def fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def fmt_seconds(value: float | None, unit: str = "ms") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if unit == "ms" else f"{value:.1f} s"
