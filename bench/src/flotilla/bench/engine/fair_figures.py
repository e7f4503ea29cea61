"""The figures of `flotilla engine bench fair` (how they are defined: see fair.py's docstring):
per-request records, percentiles, Jain's index over max-min fair shares, the per-policy summary, the
comparison against the issue's targets, the printed report and the TTFT plot. Pure but for the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

LOUD, QUIET = "loud", "quiet"
TTFT_P95_TARGET = 5.0  # quiet TTFT p95, fcfs / fair, at least
THROUGHPUT_TARGET = 0.95  # throughput, fair / fcfs, at least


@dataclass
class RequestRecord:
    request_id: str
    tenant: str
    arrival: float  # seconds after the run starts
    demanded_tokens: int  # the output tokens it asked for
    ttft: float | None = None  # None: no first token before the run ended
    output_tokens: int = 0
    window_tokens: int = 0  # of those, generated while arrivals went on
    finished: bool = False


# -- the figures (pure) ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def jain_index(xs: Sequence[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything; NaN when all are 0."""
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return math.nan
    return sum(xs) ** 2 / (len(xs) * squares)


def max_min_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: split `capacity` equally, never giving a tenant more than it demands; what a
    tenant leaves is split among the others."""
    shares: dict[str, float] = {}
    left, remaining = capacity, len(demands)
    for tenant, demand in sorted(demands.items(), key=lambda item: item[1]):
        shares[tenant] = min(demand, left / remaining)
        left -= shares[tenant]
        remaining -= 1
    return shares


def summarize(records: Sequence[RequestRecord], duration: float, end: float) -> dict[str, Any]:
    """The figures of one run: `duration` is how long arrivals went on (the overload window), `end` when
    the run stopped, both in seconds after it started."""
    tenants = sorted({r.tenant for r in records})
    window_total = sum(r.window_tokens for r in records)
    run_total = sum(r.output_tokens for r in records)
    demands = {t: float(sum(r.demanded_tokens for r in records if r.tenant == t)) for t in tenants}
    fair = max_min_shares(demands, float(window_total))
    per_tenant: dict[str, Any] = {}
    normalized = []
    for tenant in tenants:
        mine = [r for r in records if r.tenant == tenant]
        ttfts = [r.ttft if r.ttft is not None else end - r.arrival for r in mine]
        window = sum(r.window_tokens for r in mine)
        served = window / fair[tenant] if fair[tenant] > 0 else 0.0
        normalized.append(served)
        per_tenant[tenant] = {
            "offered": len(mine),
            "finished": sum(r.finished for r in mine),
            "unfinished": sum(not r.finished for r in mine),
            "without_first_token": sum(r.ttft is None for r in mine),
            "ttft_s": {
                "mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
                "p50": percentile(ttfts, 0.50),
                "p95": percentile(ttfts, 0.95),
                "p99": percentile(ttfts, 0.99),
            },
            "demanded_tokens": int(demands[tenant]),
            "output_tokens": sum(r.output_tokens for r in mine),
            "window_tokens": window,
            "token_share": window / window_total if window_total else math.nan,
            "token_share_run": sum(r.output_tokens for r in mine) / run_total if run_total else math.nan,
            "fair_share_tokens": fair[tenant],
            "served_over_fair_share": served,
        }
    return {
        "offered": len(records),
        "finished": sum(r.finished for r in records),
        "unfinished": sum(not r.finished for r in records),
        "arrivals_s": duration,
        "run_s": end,
        "output_tokens": run_total,
        "window_tokens": window_total,
        "throughput_tok_s": run_total / end if end > 0 else math.nan,
        "window_throughput_tok_s": window_total / duration if duration > 0 else math.nan,
        "jain_index": jain_index(normalized),
        "tenants": per_tenant,
    }


def compare(fcfs: dict[str, Any], fair: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, from two summaries of the same arrivals."""
    p95_fcfs = fcfs["tenants"][QUIET]["ttft_s"]["p95"]
    p95_fair = fair["tenants"][QUIET]["ttft_s"]["p95"]
    ttft_ratio = p95_fcfs / p95_fair if p95_fair > 0 else math.inf
    throughput_ratio = fair["throughput_tok_s"] / fcfs["throughput_tok_s"]
    return {
        "quiet_ttft_p95_fcfs_over_fair": ttft_ratio,
        "quiet_ttft_p95_target": TTFT_P95_TARGET,
        "quiet_ttft_p95_met": ttft_ratio >= TTFT_P95_TARGET,
        "throughput_fair_over_fcfs": throughput_ratio,
        "throughput_target": THROUGHPUT_TARGET,
        "throughput_met": throughput_ratio >= THROUGHPUT_TARGET,
    }


# -- the runs --------------------------------------------------------------------------------------------


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"model {r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads), max_num_seqs {r['max_num_seqs']}"
    ]
    if "calibration" in r:
        c = r["calibration"]
        lines.append(f"capacity (closed loop, {c['seconds']:.1f} s): {c['capacity_tok_s']:.0f} output tok/s")
    rates = r["rates"]
    load = f" ({rates['overload']:.2f}x capacity)" if rates["overload"] else ""
    lines.append(
        f"offered: loud {rates['loud_req_s']:.2f} req/s ({rates['loud_requests']} requests), quiet "
        f"{rates['quiet_req_s']:.2f} req/s ({rates['quiet_requests']}), {rates['offered_tok_s']:.0f} output tok/s"
        f"{load} for {r['duration_s']:g} s; input {r['input_len']}, output {r['output_len']} tokens"
    )
    for policy, s in r["runs"].items():
        lines.append(
            f"{policy}: {s['throughput_tok_s']:.0f} output tok/s over {s['run_s']:.1f} s "
            f"({s['window_throughput_tok_s']:.0f} during arrivals), Jain's index {s['jain_index']:.3f}, "
            f"{s['finished']}/{s['offered']} finished"
        )
        lines.append(
            f"  {'tenant':<8}{'requests':>9}{'unfinished':>11}{'TTFT p50':>10}{'p95':>9}{'p99':>9} (ms)"
            f"{'token share':>13}{'served/fair':>13}"
        )
        for tenant, t in s["tenants"].items():
            ttft = t["ttft_s"]
            lines.append(
                f"  {tenant:<8}{t['offered']:>9}{t['unfinished']:>11}{ttft['p50'] * 1e3:>10.0f}"
                f"{ttft['p95'] * 1e3:>9.0f}{ttft['p99'] * 1e3:>9.0f}     {t['token_share']:>13.3f}"
                f"{t['served_over_fair_share']:>13.3f}"
            )
        censored = sum(t["without_first_token"] for t in s["tenants"].values())
        if censored:
            lines.append(
                f"  {censored} requests got no first token before the run ended: their TTFT counts as "
                "end of run - arrival (a lower bound)"
            )
    lines.append(
        "token share: of the tokens generated while arrivals went on; served/fair: those tokens over the "
        "tenant's max-min fair share of them (Jain's index is over these)"
    )
    if "comparison" in r:
        c = r["comparison"]
        p95 = {p: r["runs"][p]["tenants"][QUIET]["ttft_s"]["p95"] * 1e3 for p in ("fcfs", "fair")}
        lines.append(
            f"quiet TTFT p95: fcfs {p95['fcfs']:.0f} ms / fair {p95['fair']:.0f} ms = "
            f"{c['quiet_ttft_p95_fcfs_over_fair']:.1f}x (target >= {c['quiet_ttft_p95_target']:g}x): "
            f"{'PASS' if c['quiet_ttft_p95_met'] else 'MISS'}"
        )
        lines.append(
            f"throughput: fair / fcfs = {c['throughput_fair_over_fcfs']:.3f} "
            f"(target >= {c['throughput_target']:g}): {'PASS' if c['throughput_met'] else 'MISS'}"
        )
    return "\n".join(lines)


def plot(runs: dict[str, tuple[list[RequestRecord], float]], duration: float, path: str) -> None:
    """TTFT against arrival time, per tenant, one panel per policy (runs: policy -> (records, end of the
    run)); hollow marks: no first token, plotted at end of run - arrival (a lower bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(runs), 1, figsize=(9, 3.2 * len(runs)), sharex=True, sharey=True, squeeze=False
    )
    colors = {LOUD: "tab:orange", QUIET: "tab:blue"}
    for ax, (policy, (records, end)) in zip(axes[:, 0], runs.items(), strict=True):
        for tenant in (LOUD, QUIET):
            got = [r for r in records if r.tenant == tenant and r.ttft is not None]
            ax.scatter([r.arrival for r in got], [max(r.ttft or 0.0, 1e-4) for r in got], s=8,
                       color=colors[tenant], label=tenant, alpha=0.7)  # fmt: skip
            missed = [r for r in records if r.tenant == tenant and r.ttft is None]
            if missed:
                ax.scatter([r.arrival for r in missed], [max(end - r.arrival, 1e-4) for r in missed], s=14,
                           facecolors="none", edgecolors=colors[tenant], label=f"{tenant}, no first token")  # fmt: skip
        ax.axvline(duration, color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(policy)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("arrival (s since the run began)")
    fig.suptitle("flotilla engine bench fair: TTFT by arrival time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
