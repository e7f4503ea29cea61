"""The sizes, targets and figures of `flotilla engine bench gpu` (gpu.py runs the checks): what each
check runs at full size (an H200, within ten minutes) and with --quick (a CPU smoke run), the
bandwidth arithmetic, the verdicts against the issue's targets, the printed summary and the PNG. Pure but
for the plot; no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The targets on an H200 (issue 16, item 5).
ATTENTION_BANDWIDTH_TARGET = 0.80  # decode attention GB/s over the measured copy GB/s, at least
BATCH1_UTILIZATION_TARGET = 0.70  # batch-1 decode: weight bytes x tok/s over the copy GB/s, at least
GENERATE_BATCH_SPEEDUP_TARGET = 2.0  # engine output tok/s over transformers' generate_batch, at least
KERNELS_TARGET = 1.0  # the share of kernel cases within tolerance

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class KernelShape:
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionShape:
    """A decode-bandwidth case: `batch` requests of `context` cached tokens each."""

    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return (
            f"b{self.batch}_ctx{self.context}_gqa{self.num_heads // self.num_kv_heads}_d{self.head_dim}"
            f"_bs{self.block_size}"
        )


@dataclass(frozen=True)
class Sizes:
    # copy bandwidth and every device timing: warm-up calls, timed samples (median), calls per sample
    copy_bytes: int
    warmup: int
    repeats: int
    inner: int
    # kernels vs the reference: each decode shape with each batch of lengths, each prefill shape with the
    # chunks (cached context, new tokens), the KV store over store_tokens tokens; in each dtype
    kernel_dtypes: tuple[str, ...]
    decode_shapes: tuple[KernelShape, ...]
    decode_lens: tuple[tuple[int, ...], ...]
    prefill_shapes: tuple[KernelShape, ...]
    prefill_chunks: tuple[tuple[int, int], ...]
    store_tokens: int
    # decode attention bandwidth: the first shape is the headline
    attention: tuple[AttentionShape, ...]
    # the model (gpu_model.py) and the engine runs
    model: str
    batch1_prompt_len: int
    batch1_output_len: int
    batch1_runs: int
    num_prompts: int
    input_len: tuple[int, int]
    output_len: int  # one length for all, so generate_batch runs the workload in one call
    max_num_seqs: int
    hf_sequential_prompts: int
    kv_cache_bytes: int
    # ContinuousBatchingConfig fields for generate_batch (None: transformers sizes its cache itself)
    hf_continuous_batching: dict[str, int] | None = field(default=None)


FULL = Sizes(
    copy_bytes=GIB,
    warmup=5,
    repeats=20,
    inner=5,
    kernel_dtypes=("float16", "bfloat16"),
    decode_shapes=(
        KernelShape(16, 8, 8, 128),  # GQA 1
        KernelShape(16, 32, 8, 64),  # GQA 4: the 1B model's heads
        KernelShape(32, 32, 8, 128),  # GQA 4
        KernelShape(16, 32, 4, 128),  # GQA 8
        KernelShape(32, 16, 2, 64),  # GQA 8
        KernelShape(16, 12, 4, 64),  # GQA 3: a group padded to 4 rows
    ),
    # One split (short), two (mid) and sixteen (long, the cap): ragged, with one-token and block-edge rows.
    decode_lens=((1, 7, 31, 200), (5, 64, 700), (1, 33, 1000, 4097)),
    prefill_shapes=(
        KernelShape(16, 8, 8, 64),
        KernelShape(16, 32, 8, 128),
        KernelShape(32, 32, 4, 64),
        KernelShape(32, 12, 4, 128),
    ),
    # A fresh prompt over several query tiles, a chunk after a prefix ending mid-block, a prefix-cache hit
    # with 3 new tokens, one new token, and a long chunk after a long prefix.
    prefill_chunks=((0, 300), (21, 64), (32, 3), (11, 1), (1000, 130)),
    store_tokens=300,
    attention=(
        AttentionShape(64, 4096, 32, 8, 128, 16),  # headline: Llama-3-8B's heads, 1 GiB of KV
        AttentionShape(64, 4096, 32, 8, 64, 16),  # the 1B model's heads
        AttentionShape(64, 4096, 32, 8, 128, 32),
        AttentionShape(1, 32768, 32, 8, 128, 16),  # one long request: 16 splits
    ),
    model="llama-1b",
    batch1_prompt_len=128,
    batch1_output_len=256,
    batch1_runs=3,
    num_prompts=64,
    input_len=(32, 256),
    output_len=128,
    max_num_seqs=64,
    hf_sequential_prompts=8,
    kv_cache_bytes=4 * GIB,
)

QUICK = Sizes(
    copy_bytes=16 * MIB,
    warmup=1,
    repeats=3,
    inner=1,
    kernel_dtypes=("float16", "bfloat16"),
    decode_shapes=(KernelShape(16, 8, 2, 64), KernelShape(32, 4, 4, 32)),
    decode_lens=((1, 5, 40), (1, 17, 600)),
    prefill_shapes=(KernelShape(16, 8, 2, 64),),
    prefill_chunks=((0, 40), (21, 10), (32, 3), (11, 1)),
    store_tokens=12,
    attention=(AttentionShape(2, 64, 8, 2, 64, 16, "float16"),),
    model="llama-tiny",
    batch1_prompt_len=16,
    batch1_output_len=16,
    batch1_runs=1,
    num_prompts=8,
    input_len=(8, 32),
    output_len=8,
    max_num_seqs=8,
    hf_sequential_prompts=2,
    kv_cache_bytes=64 * MIB,
    hf_continuous_batching={"num_blocks": 16, "max_batch_tokens": 256, "page_size": 32},
)


# -- arithmetic ----------------------------------------------------------------------------------------
def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def bandwidth_utilization(
    bytes_per_token: float, tokens_per_s: float, copy_gb_per_s: float | None
) -> float | None:
    """Bytes a decode step must read (here: the weights) x steps per second, over the copy bandwidth."""
    return ratio(bytes_per_token * tokens_per_s / 1e9, copy_gb_per_s)


def decode_tokens_per_s(token_times: list[float]) -> float | None:
    """Tokens per second after the first (so prefill is out): (n - 1) over the first-to-last gap."""
    if len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return None
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


# -- verdicts ------------------------------------------------------------------------------------------
def verdict(name: str, label: str, value: float | None, target: float) -> dict[str, Any]:
    """passed: None when the figure was not measured."""
    finite = value is not None and math.isfinite(value)
    return {
        "name": name,
        "label": label,
        "value": value if finite else None,
        "target": target,
        "passed": (value >= target) if finite and value is not None else None,
    }


def verdicts(checks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    kernels = checks.get("kernels", {})
    counted = kernels.get("passed", 0) + kernels.get("failed", 0) + kernels.get("errors", 0)
    attention = checks.get("decode_attention_bandwidth", {})
    return [
        verdict("kernels", "kernel cases within tolerance", ratio(kernels.get("passed"), counted), KERNELS_TARGET),
        verdict("decode_attention_bandwidth", "decode attention GB/s / copy GB/s",
                attention.get("headline_copy_bandwidth_ratio"), ATTENTION_BANDWIDTH_TARGET),
        verdict("batch1_decode", "batch-1 decode bandwidth utilisation",
                checks.get("batch1_decode", {}).get("bandwidth_utilization"), BATCH1_UTILIZATION_TARGET),
        verdict("throughput_vs_transformers", "engine tok/s / transformers generate_batch",
                checks.get("throughput_vs_transformers", {}).get("speedup_vs_hf_generate_batch"),
                GENERATE_BATCH_SPEEDUP_TARGET),
    ]  # fmt: skip


def verdict_line(v: dict[str, Any]) -> str:
    if v["value"] is None:
        return f"  {v['label']:<44} not measured (target >= {v['target']:g})"
    mark = "PASS" if v["passed"] else "FAIL"
    return f"  {v['label']:<44} {v['value']:8.3f}  target >= {v['target']:g}  {mark}"


def print_summary(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"flotilla engine bench gpu on {env['device_name']} ({'quick' if report['quick'] else 'full'} sizes)"
    )
    if env["device_type"] != "cuda":
        print("  NOTE: not a CUDA device; every figure below is a smoke-run figure and means nothing")
    for name, entry in report["checks"].items():
        line = f"  {name:<28} {entry['status']:<8} {entry.get('seconds', 0.0):6.1f} s"
        if entry.get("summary"):
            line += f"  {entry['summary']}"
        if entry.get("reason"):
            line += f"  ({entry['reason']})"
        if entry.get("error"):
            line += f"  ERROR {entry['error']}"
        print(line)
    print("targets:")
    for v in report["verdicts"]:
        print(verdict_line(v))


# -- the plot ------------------------------------------------------------------------------------------
def plot(report: dict[str, Any], path: str) -> None:
    """One bar per figure with a target (the decode attention bar for each shape measured), the target
    as a black tick over it; green: met, red: missed, grey: not measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, float | None, float]] = []
    for v in report["verdicts"]:
        bars.append((v["label"], v["value"], v["target"]))
        if v["name"] == "decode_attention_bandwidth":
            for case in report["checks"].get("decode_attention_bandwidth", {}).get("cases", [])[1:]:
                bars.append((f"  {case['name']}", case.get("copy_bandwidth_ratio"), v["target"]))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(bars) + 1.6))
    top = max([t for _, _, t in bars] + [b for _, b, _ in bars if b is not None]) * 1.15
    for i, (_, value, target) in enumerate(bars):
        color = "lightgrey" if value is None else ("tab:green" if value >= target else "tab:red")
        ax.barh(i, value or 0.0, color=color)
        ax.plot([target, target], [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.text(
            (value or 0.0) + top * 0.01, i, "not measured" if value is None else f"{value:.3f}", va="center"
        )
    ax.set_yticks(range(len(bars)), [label for label, _, _ in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, top)
    ax.set_xlabel("ratio (black tick: target)")
    env = report["environment"]
    title = f"flotilla engine bench gpu: {env['device_name']}"
    if env["device_type"] != "cuda":
        title += " (smoke run: figures mean nothing)"
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
