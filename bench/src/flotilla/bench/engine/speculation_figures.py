"""The speculation report's verdicts against the issue's targets, its table and its figure (no torch)."""

from __future__ import annotations

from typing import Any

BATCH1_TARGET = 1.5  # the better method at batch 1, against no speculation
FULL_BATCH_FLOOR = 0.95  # a full batch may lose at most 5%


def _label(row: dict[str, Any]) -> str:
    return "none" if row["method"] == "none" else f"{row['method']} K={row['k']}"


def verdicts(report: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in report["rows"] if r["method"] != "none"]
    if not rows:
        return {}
    best = max(rows, key=lambda r: r["batch1_speedup"])
    worst_full = min(r["full_batch_ratio"] for r in rows)
    return {
        "best_batch1": _label(best),
        "best_batch1_speedup": best["batch1_speedup"],
        "batch1_target": BATCH1_TARGET,
        "batch1_met": best["batch1_speedup"] >= BATCH1_TARGET,
        "worst_full_batch_ratio": worst_full,
        "full_batch_floor": FULL_BATCH_FLOOR,
        "full_batch_met": worst_full >= FULL_BATCH_FLOOR,
        "all_identical": all(r["identical_to_none"] for r in rows),
    }


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}, draft {report['draft_model'] or '-'} on {report['device']} "
        f"({report['threads']} threads); {report['prompts']} corpus prompts, up to {report['max_tokens']} greedy "
        f"tokens each; median of {report['repeats']} runs",
        f"  {'method':<12}{'tok/s b1':>10}{'x none':>8}{'accept':>8}{'mean len':>9}{'identical':>10}"
        f"{'tok/s b' + str(report['full_batch']):>12}{'x none':>8}{'forced x':>9}  per position",
    ]
    for row in report["rows"]:
        per_position = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
        identical = "-" if row["identical_to_none"] is None else ("yes" if row["identical_to_none"] else "NO")
        lines.append(
            f"  {_label(row):<12}{row['batch1_tokens_per_s']:>10.1f}{row['batch1_speedup']:>8.2f}"
            f"{_num(row['acceptance_rate'], '.2f'):>8}{_num(row['mean_accepted_length'], '.2f'):>9}{identical:>10}"
            f"{row['full_batch_tokens_per_s']:>12.1f}{row['full_batch_ratio']:>8.2f}"
            f"{_num(row.get('full_batch_forced_ratio'), '.2f'):>9}  {per_position}"
        )
    v = report.get("verdicts") or {}
    if v:
        lines.append(
            f"batch 1: best {v['best_batch1']} at {v['best_batch1_speedup']:.2f}x of none (target >= "
            f"{v['batch1_target']}x: {'met' if v['batch1_met'] else 'MISSED'}); full batch of {report['full_batch']} "
            f"(speculation off above {report['speculative_max_batch_size']} running): worst {v['worst_full_batch_ratio']:.2f}x "
            f"(floor {v['full_batch_floor']}x: {'met' if v['full_batch_met'] else 'MISSED'}); greedy outputs "
            f"{'identical to none' if v['all_identical'] else 'DIFFER from none'}"
        )
    lines.append(
        "mean len: tokens per verifying step (accepted drafts + the target's own); forced x: the full batch with "
        "speculation kept on, against none"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Two panels: batch-1 and full-batch throughput over none per configuration (dashed: the targets), and
    the acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    x = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    left.bar([i - width / 2 for i in x], [r["batch1_speedup"] for r in rows], width, label="batch 1")
    left.bar(
        [i + width / 2 for i in x],
        [r["full_batch_ratio"] for r in rows],
        width,
        label=f"batch {report['full_batch']}",
    )
    left.axhline(BATCH1_TARGET, color="tab:blue", linestyle="--", linewidth=1)
    left.axhline(FULL_BATCH_FLOOR, color="tab:orange", linestyle="--", linewidth=1)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(x, [_label(r) for r in rows], rotation=20)
    left.set_ylabel("output tok/s / none")
    left.set_title("throughput against no speculation (dashed: targets)")
    left.legend()
    for row in rows:
        if row["acceptance_per_position"]:
            positions = range(1, len(row["acceptance_per_position"]) + 1)
            right.plot(positions, row["acceptance_per_position"], marker="o", label=_label(row))
    right.set_xticks(range(1, max((len(r["acceptance_per_position"]) for r in rows), default=1) + 1))
    right.set_xlabel("draft position")
    right.set_ylabel("accepted / drafts")
    right.set_ylim(0, 1)
    right.set_title("acceptance per draft position (batch 1)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
