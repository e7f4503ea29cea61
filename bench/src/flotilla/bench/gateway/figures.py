"""The benchmarks' arithmetic, pure: percentiles, reading a Prometheus exposition, the JSON summaries.

Latencies are kept in seconds and reported in milliseconds. A figure that cannot be computed (no samples,
a zero denominator) is None in the JSON, never NaN (which JSON does not have)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

QUANTILES = (50, 90, 95, 99)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between order statistics (numpy's default);
    NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, Any]:
    """n, mean, p50/p90/p95/p99 and max of `values` x `scale` (seconds -> ms by default)."""
    scaled = [v * scale for v in values]
    out: dict[str, Any] = {"n": len(scaled), "mean": statistics.fmean(scaled) if scaled else math.nan}
    out.update({f"p{q}": percentile(scaled, q) for q in QUANTILES})
    out["max"] = max(scaled) if scaled else math.nan
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator or math.isnan(numerator + denominator):
        return None
    return numerator / denominator


def json_safe(value: Any) -> Any:
    """NaN and infinities become None, recursively (json.dumps would write invalid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


# -- a Prometheus text exposition ---------------------------------------------------------------------------
def samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        yield name, dict(_LABEL.findall(labels or "")), number


def sample_sum(text: str, name: str) -> float:
    """The sum of every sample named exactly `name`, over all its label sets (0 when there is none)."""
    return sum(value for sample, _, value in samples(text) if sample == name)


def sample_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Samples named `name`, summed per value of `label`."""
    out: dict[str, float] = {}
    for sample, labels, value in samples(text):
        if sample == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in sorted(set(before) | set(after))}


# -- `routing` --------------------------------------------------------------------------------------------
@dataclass
class ChatRecord:
    """One chat turn as the client saw it. `start` is seconds since the phase began."""

    conversation: int
    system: int
    turn: int
    start: float
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # to the first chunk with content
    latency: float | None = None  # to the end of the stream
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the engine's usage.prompt_tokens_details.cached_tokens


def routing_summary(
    records: Sequence[ChatRecord],
    duration: float,
    engine_hits: float,
    engine_queries: float,
    gateway_hit_tokens: float,
    gateway_prompt_tokens: float,
    decisions: Mapping[str, float],
    replica_requests: Sequence[float] = (),
) -> dict[str, Any]:
    """One policy's figures. The engine counters and the gateway's are deltas over the measured phase;
    `replica_requests` is how many requests each replica finished in it."""
    good = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in good)
    prompt = sum(r.prompt_tokens for r in good)
    later = [r for r in good if r.turn > 0]
    return {
        "requests": len(records),
        "ok": len(good),
        "failed": len(records) - len(good),
        "duration_s": duration,
        "ttft_ms": distribution([r.ttft for r in good if r.ttft is not None]),
        "ttft_first_turn_ms": distribution([r.ttft for r in good if r.ttft is not None and r.turn == 0]),
        "ttft_later_turns_ms": distribution([r.ttft for r in later if r.ttft is not None]),
        "latency_ms": distribution([r.latency for r in good if r.latency is not None]),
        "output_tokens": output,
        "output_tok_s": output / duration if duration > 0 else None,
        "requests_per_s": len(good) / duration if duration > 0 else None,
        "prompt_tokens_mean": prompt / len(good) if good else None,
        "prompt_tokens_max": max((r.prompt_tokens for r in good), default=None),
        "usage_cached_share": ratio(sum(r.cached_tokens for r in good), prompt),
        "engine_prefix_hit_rate": ratio(engine_hits, engine_queries),
        "engine_prefix_hits": engine_hits,
        "engine_prefix_queries": engine_queries,
        "gateway_predicted_hit_share": ratio(gateway_hit_tokens, gateway_prompt_tokens),
        "routing_decisions": {k: v for k, v in decisions.items() if v},
        "replica_requests": list(replica_requests),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def compare_policies(policies: Mapping[str, Mapping[str, Any]], target: float) -> dict[str, Any] | None:
    """The first policy's (the baseline's) TTFT over the last's, at p50 and p95; `met` when the p95 ratio
    reaches `target`. None with a single policy."""
    names = list(policies)
    if len(names) < 2:
        return None
    baseline, candidate = policies[names[0]], policies[names[-1]]
    p95 = ratio(baseline["ttft_ms"]["p95"], candidate["ttft_ms"]["p95"])
    return {
        "baseline": names[0],
        "candidate": names[-1],
        "ttft_p95_ratio": p95,
        "ttft_p50_ratio": ratio(baseline["ttft_ms"]["p50"], candidate["ttft_ms"]["p50"]),
        "output_tok_s_ratio": ratio(candidate["output_tok_s"], baseline["output_tok_s"]),
        "target_ttft_p95_ratio": target,
        "met": p95 is not None and p95 >= target,
    }


def format_routing(policies: Mapping[str, Mapping[str, Any]], comparison: Mapping[str, Any] | None) -> str:
    def num(value: Any, spec: str) -> str:
        return (
            "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
        )

    rows = [
        ("requests ok / failed", lambda s: f"{s['ok']} / {s['failed']}"),
        ("TTFT p50 (ms)", lambda s: num(s["ttft_ms"]["p50"], ".1f")),
        ("TTFT p95 (ms)", lambda s: num(s["ttft_ms"]["p95"], ".1f")),
        ("TTFT p95, first turns (ms)", lambda s: num(s["ttft_first_turn_ms"]["p95"], ".1f")),
        ("TTFT p95, later turns (ms)", lambda s: num(s["ttft_later_turns_ms"]["p95"], ".1f")),
        ("latency p50 (ms)", lambda s: num(s["latency_ms"]["p50"], ".1f")),
        ("latency p95 (ms)", lambda s: num(s["latency_ms"]["p95"], ".1f")),
        ("output tok/s", lambda s: num(s["output_tok_s"], ".1f")),
        ("prompt tokens, mean", lambda s: num(s["prompt_tokens_mean"], ".0f")),
        ("engine prefix-cache hit rate", lambda s: num(s["engine_prefix_hit_rate"], ".1%")),
        ("gateway predicted hit share", lambda s: num(s["gateway_predicted_hit_share"], ".1%")),
        ("requests per replica", lambda s: "/".join(f"{n:.0f}" for n in s["replica_requests"]) or "-"),
    ]
    names = list(policies)
    lines = [f"{'':<30}" + "".join(f"{n:>14}" for n in names)]
    for label, cell in rows:
        lines.append(f"{label:<30}" + "".join(f"{cell(policies[n]):>14}" for n in names))
    if comparison is not None:
        p95, target = comparison["ttft_p95_ratio"], comparison["target_ttft_p95_ratio"]
        verdict = "MET" if comparison["met"] else "MISSED"
        lines.append(
            f"TTFT p95 {comparison['baseline']} / {comparison['candidate']}: {num(p95, '.2f')}x "
            f"(target >= {target:g}x: {verdict}); p50 ratio {num(comparison['ttft_p50_ratio'], '.2f')}x"
        )
    for name in names:
        for error in policies[name]["errors"]:
            lines.append(f"{name} error: {error}")
    return "\n".join(lines)


# -- `overhead` -------------------------------------------------------------------------------------------
SERVED_PLANES = ("relay", "envoy")  # what `--data-plane` chooses among
# The floor under any picker (`overhead --bounds`, bounds.py): measured in front of the stub only.
ENVOY_ALONE, NULL_PICKER, NULL_PICKER_REQUEST_PHASES = (
    "envoy-alone",
    "null-picker",
    "null-picker-request-phases",
)
BOUND_PLANES = (ENVOY_ALONE, NULL_PICKER, NULL_PICKER_REQUEST_PHASES)
DATA_PLANE_NAMES = {
    "relay": "the relay",
    "envoy": "Envoy + picker",
    ENVOY_ALONE: "Envoy alone (no ext_proc)",
    NULL_PICKER: "Envoy + null Go picker",
    NULL_PICKER_REQUEST_PHASES: "Envoy + null Go picker, request phases only",
}


def data_planes(choice: str, first: str) -> tuple[str, ...]:
    """The data planes a `--data-plane` choice (`envoy`, `relay` or `both`) runs, `first` first when both."""
    if choice != "both":
        return (choice,)
    return (first, *(plane for plane in SERVED_PLANES if plane != first))


CLIENT_BOUND_SHARE = 0.7  # a data plane above this share of the client's own ceiling measures the client


def added_latency(
    direct: Sequence[float], through: Sequence[float], targets_ms: Mapping[str, float]
) -> dict[str, Any]:
    """Sequential requests through one data plane against the same straight to the upstream: the added
    latency is their difference, percentile by percentile. `targets_ms` (a percentile such as "p50" -> ms)
    are each checked; `met` when there is one and all are met."""
    d, t = distribution(direct), distribution(through)
    added = {f"p{q}": t[f"p{q}"] - d[f"p{q}"] for q in QUANTILES}
    added["mean"] = t["mean"] - d["mean"]
    checks = {
        q: {"added_ms": added[q], "target_ms": limit, "met": not math.isnan(added[q]) and added[q] <= limit}
        for q, limit in targets_ms.items()
    }
    return {
        "through_ms": t,
        "added_ms": added,
        "targets": checks,
        "met": bool(checks) and all(c["met"] for c in checks.values()),
    }


def latency_summary(
    samples_s: Mapping[str, Sequence[float]], targets_ms: Mapping[str, Mapping[str, float]]
) -> dict[str, Any]:
    """`samples_s["direct"]` and one list per data plane (seconds): the direct distribution, and each data
    plane's added latency against its targets (`targets_ms[plane]`, none when absent)."""
    direct = samples_s["direct"]
    return {
        "direct_ms": distribution(direct),
        "data_planes": {
            plane: added_latency(direct, values, targets_ms.get(plane, {}))
            for plane, values in samples_s.items()
            if plane != "direct"
        },
    }


def throughput_summary(
    latencies: Sequence[float], errors: int, duration: float, concurrency: int
) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "duration_s": duration,
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / duration if duration > 0 else None,
        "latency_ms": distribution(latencies),
    }


def cpu_shares(
    before: Mapping[str, float | None], after: Mapping[str, float | None], wall_s: float
) -> dict[str, float | None]:
    """Each process's CPU time over a run of `wall_s` seconds, as a share of one core (None when either
    reading is missing)."""
    shares: dict[str, float | None] = {}
    for name, end in after.items():
        begin = before.get(name)
        shares[name] = None if begin is None or end is None else ratio(end - begin, wall_s)
    return shares


def ceiling_comparison(
    planes: Mapping[str, Mapping[str, Any]], client: Mapping[str, Any], target: float
) -> dict[str, Any]:
    """The pinned data planes' requests/s (throughput summaries by plane): Envoy + picker's over the
    relay's against `target` (None, not met, without both), every other plane's over the relay's too
    (`over_relay`), and which planes came within CLIENT_BOUND_SHARE of `client` (the same loop straight
    to the stub): their figure is a floor."""
    rps = {plane: summary["requests_per_s"] for plane, summary in planes.items()}
    over = ratio(rps.get("envoy"), rps.get("relay"))
    over_relay = {plane: ratio(value, rps.get("relay")) for plane, value in rps.items() if plane != "relay"}
    ceiling = client.get("requests_per_s")
    bound = sorted(
        plane for plane, value in rps.items() if value and ceiling and value >= CLIENT_BOUND_SHARE * ceiling
    )
    return {
        "requests_per_s": rps,
        "client_requests_per_s": ceiling,
        "envoy_over_relay": over,
        "over_relay": over_relay,
        "target_ratio": target,
        "met": over is not None and over >= target,
        "client_bound": bound,
    }


def format_overhead(report: Mapping[str, Any]) -> str:
    """The printed figures of `overhead`: the latency table per upstream and data plane, each target's
    verdict, and the throughput ceilings with their ratio."""
    settings = report["settings"]
    keys = ("p50", "p90", "p95", "p99", "mean")
    lines = [f"{'sequential requests (ms)':<36}" + "".join(f"{k:>10}" for k in keys)]
    runs = (("the engine", report["latency"]), ("the stub", report["latency_instant_upstream"]))
    for upstream, figures in runs:
        lines.append(
            f"{'straight to ' + upstream:<36}" + "".join(f"{_ms(figures['direct_ms'][k])}" for k in keys)
        )
        for plane, summary in figures["data_planes"].items():
            name = DATA_PLANE_NAMES.get(plane, plane)
            for label, row in (
                (f"  through {name}", summary["through_ms"]),
                (f"    added by {name}", summary["added_ms"]),
            ):
                lines.append(f"{label:<36}" + "".join(_ms(row[k]) for k in keys))
            reported = summary.get("reported_added_mean_ms")
            if reported is not None:
                lines.append(f"{'    its own arrival->send, mean':<36}{'':>40}{_ms(reported)}")
    for plane, summary in report["latency"]["data_planes"].items():
        checks = "; ".join(
            f"{q} {_num(c['added_ms'], '.3f')} ms (target <= {c['target_ms']:g} ms: {_verdict(c['met'])})"
            for q, c in summary["targets"].items()
        )
        stub = report["latency_instant_upstream"]["data_planes"][plane]["added_ms"]["p50"]
        lines.append(f"added by {DATA_PLANE_NAMES.get(plane, plane)} in front of the engine: {checks or '-'}; "
                     f"p50 in front of the stub {_num(stub, '.3f')} ms")  # fmt: skip
    errors = report["latency"]["errors"] + report["latency_instant_upstream"]["errors"]
    lines.append(f"{errors} sequential requests failed")
    thr = report["throughput"]
    for plane in thr["comparison"]["requests_per_s"]:
        t = thr[plane]
        lines.append(
            f"throughput through {DATA_PLANE_NAMES.get(plane, plane)} pinned to CPU {settings['gateway_cpu']}: "
            f"{_num(t['requests_per_s'], '.0f')} requests/s at concurrency {t['concurrency']} (latency p50 "
            f"{_num(t['latency_ms']['p50'], '.2f')} ms, p99 {_num(t['latency_ms']['p99'], '.2f')} ms, "
            f"{t['errors']} errors)" + _shares(t.get("cpu_share"))
        )
    comparison = thr["comparison"]
    lines.append(f"the same client straight to the stub: {_num(comparison['client_requests_per_s'], '.0f')} "
                 f"requests/s (the client's own ceiling)")  # fmt: skip
    if comparison["envoy_over_relay"] is not None:
        lines.append(
            f"requests/s on one core, Envoy + picker over the relay: {comparison['envoy_over_relay']:.2f}x "
            f"(target >= {comparison['target_ratio']:g}x: {_verdict(comparison['met'])})"
        )
    for plane in BOUND_PLANES:
        over = comparison.get("over_relay", {}).get(plane)
        if over is not None:
            lines.append(
                f"requests/s on one core, {DATA_PLANE_NAMES[plane]} over the relay: {over:.2f}x (a bound)"
            )
    for plane in comparison["client_bound"]:
        lines.append(
            f"warning: {DATA_PLANE_NAMES.get(plane, plane)} came within {CLIENT_BOUND_SHARE:.0%} of the "
            "client's own ceiling: its figure is a floor, not its ceiling"
        )
    return "\n".join(lines)


def _shares(shares: Mapping[str, float | None] | None) -> str:
    known = {name: share for name, share in (shares or {}).items() if share is not None}
    return f"; of the core: {', '.join(f'{n} {v:.0%}' for n, v in known.items())}" if known else ""


def _num(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _ms(value: Any) -> str:
    return f"{_num(value, '.3f'):>10}"


def _verdict(met: bool) -> str:
    return "MET" if met else "MISSED"
