"""The PNGs of the comparisons with vLLM: each system's figure per round beside Flotilla/vLLM per round, its
median and the issue's target (no torch; matplotlib loads inside the functions)."""

from __future__ import annotations

from typing import Any

from flotilla.bench.engine.compare_report import LATENCIES, SYSTEMS, TARGETS

COLORS = {"flotilla": "tab:blue", "vllm": "tab:orange"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ratio_panel(ax, per_round: list[float | None], median: float | None, target: float | None, what: str):
    xs = list(range(1, len(per_round) + 1))
    ax.plot(xs, [v if v is not None else float("nan") for v in per_round], marker="o", label="per round")
    if median is not None:
        ax.axhline(median, color="tab:green", label=f"median {median:.2f}x")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target}x")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(xs)
    ax.set_xlabel("round")
    ax.set_ylabel(f"flotilla / vllm, {what}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_offline(report: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    rates = report["output_tok_s"]
    rounds = len(rates["flotilla"])
    width = 0.38
    for i, system in enumerate(SYSTEMS):
        xs = [r + 1 + (i - 0.5) * width for r in range(rounds)]
        left.bar(xs, rates[system], width, label=system, color=COLORS[system])
    left.set_xticks(range(1, rounds + 1))
    left.set_xlabel("round")
    left.set_ylabel("output tok/s")
    left.legend()
    left.grid(True, axis="y", alpha=0.3)
    ratio = report["ratio"]
    _ratio_panel(right, ratio["per_round"], ratio["median"], TARGETS["output_tok_s"][1], "output tok/s")
    f = report["fairness"]
    fig.suptitle(
        f"offline: flotilla vs vLLM {report['systems']['vllm']['version']}, {report['num_prompts']} prompts, "
        f"{f['dtype']}, {f['threads']} threads"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_serve(report: dict[str, Any], path: str) -> None:
    """One row per client: the median Flotilla/vLLM ratio of each figure, with the targets; and the
    servers' start-up per round."""
    plt = _pyplot()
    clients = list(report["ratios"])
    fig, axes = plt.subplots(1, len(clients) + 1, figsize=(5.5 * (len(clients) + 1), 4.5))
    keys = ["output_tok_s"] + [key for key, _ in LATENCIES]
    names = ["output tok/s"] + [name for _, name in LATENCIES]
    for ax, client in zip(axes, clients, strict=False):
        medians = [report["ratios"][client][k]["median"] for k in keys]
        bars = ax.bar(range(len(keys)), [m if m is not None else 0 for m in medians], color="tab:blue")
        for bar, m in zip(bars, medians, strict=True):
            if m is not None:
                ax.annotate(f"{m:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        for i, key in enumerate(keys):
            if key in TARGETS:
                ax.hlines(TARGETS[key][1], i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("flotilla / vllm (median of rounds)")
        ax.set_title(f"client: {client}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    ax = axes[-1]
    rounds = report["rounds"]
    width = 0.38
    for i, system in enumerate(SYSTEMS):
        xs = [r + 1 + (i - 0.5) * width for r in range(len(rounds))]
        ax.bar(xs, [r[system]["startup_s"] for r in rounds], width, label=system, color=COLORS[system])
    ax.set_xticks(range(1, len(rounds) + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("start-up: process start to /health 200 (s)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    w = report["workload"]
    fig.suptitle(
        f"served: flotilla vs vLLM {report['vllm_version']}, {w['num_prompts']} prompts of {w['input_len']} "
        f"tokens, {w['output_len']} out, {report['fairness']['threads']} threads (red: the targets)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
