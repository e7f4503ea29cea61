"""The LoRA benchmark's table and figure (no torch)."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}, {report['threads'] or 'default'} "
        f"threads): {report['prompts']} requests of {report['input_len']} prompt and {report['output_len']} "
        f"output tokens, adapters of rank {report['rank']} on every linear layer, {report['rounds']} rounds",
        f"{'adapters':>9} {'tok/s':>9} {'x base':>7}",
    ]
    for row in report["rows"]:
        label = "base" if row["adapters"] == 0 else str(row["adapters"])
        lines.append(f"{label:>9} {row['tok_s']:>9.1f} {row['ratio_to_base']:>7.2f}")
    lines += [
        f"one active adapter: {report['slot_bytes'] / 2**20:.2f} MiB of device slot (sized for the max rank), "
        f"{report['adapter_host_bytes'] / 2**20:.2f} MiB in host memory",
        f"load: {report['load_seconds'] * 1000:.0f} ms; load to first token: "
        f"{report['load_to_first_token_seconds'] * 1000:.0f} ms",
    ]
    at_8 = next((r for r in report["rows"] if r["adapters"] == 8), None)
    if at_8 is not None:
        verdict = "met" if at_8["ratio_to_base"] >= report["target_ratio_at_8"] else "NOT met"
        lines.append(f"target: >= {report['target_ratio_at_8']}x the base at 8 adapters: {verdict}")
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = ["base" if r["adapters"] == 0 else f"{r['adapters']} adapters" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, [r["tok_s"] for r in rows], color=["#888"] + ["#3a7"] * (len(rows) - 1))
    for bar, row in zip(bars, rows, strict=True):
        ax.annotate(f"{row['ratio_to_base']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")  # fmt: skip
    ax.set_ylabel("output tok/s")
    ax.set_title(f"mixed batch, adapters of rank {report['rank']} ({report['device']}, {report['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
