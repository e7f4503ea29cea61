"""`flotilla engine bench offline --report speculation`: speculative decoding against none, on one model.

For no speculation, n-gram lookup and (with --draft-model) the draft model, at each K in --spec-tokens:
- batch 1: the corpus prompts (`corpus.sample_prompts`, whose continuations copy names from the prompt)
  one at a time, greedy, up to --spec-max-tokens tokens each; output tok/s (the median of --spec-repeats
  runs after a warm-up), the acceptance rate, the mean accepted length (tokens per verifying step) and the
  acceptance per draft position; and whether the outputs are token for token those without speculation;
- a full batch: --spec-full-batch requests at once, as the engine runs by default (speculation turns
  itself off above --speculative-max-batch-size running requests), and with speculation forced on at
  that batch, which shows why it turns off.

Meant for the trained presets (`flotilla model init --preset tiny-trained` and `tiny-trained-draft`); on
random weights nothing is accepted. Prints the table (progress on stderr), writes --json and --png;
asserts nothing."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flotilla.contract import DEFAULT_SPECULATIVE_MAX_BATCH_SIZE
from flotilla.engine.bench.speculation_figures import format_report, plot, verdicts
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.model import corpus

if TYPE_CHECKING:
    from flotilla.engine.llm_engine import LLMEngine


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be 1 or more")
    return values


def _positive(text: str) -> int:
    (value,) = _counts(text)
    return value


def add_speculation_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--report speculation", "speculative decoding against none on --model")
    group.add_argument(
        "--draft-model", help="the draft model's folder (same tokenizer); without it, n-gram only"
    )
    group.add_argument(
        "--spec-tokens",
        type=_counts,
        default=[2, 4],
        metavar="K,...",
        help="drafts per step to try (default 2,4)",
    )
    group.add_argument(
        "--spec-prompts", type=_positive, default=24, metavar="N", help="corpus prompts (default 24)"
    )
    group.add_argument(
        "--spec-max-tokens",
        type=_positive,
        default=128,
        metavar="N",
        help="most output tokens each (default 128)",
    )
    group.add_argument(
        "--spec-full-batch",
        type=_positive,
        default=32,
        metavar="B",
        help="requests in the full batch (default 32)",
    )
    group.add_argument(
        "--spec-repeats", type=_positive, default=3, metavar="N", help="runs per figure (default 3)"
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _engine(args, method: str, k: int, max_num_seqs: int, max_batch: int) -> LLMEngine:
    from flotilla.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            cpu_threads=args.threads,
            show_progress=False,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=max_num_seqs,
            speculative_method=method,
            num_speculative_tokens=k,
            speculative_model=args.draft_model if method == "draft" else None,
            speculative_max_batch_size=max_batch,
        )
    )


def _timed(
    engine: LLMEngine, batches: list[list[str]], params: SamplingParams, repeats: int
) -> tuple[float, list[list[int]]]:
    """Median output tok/s over the repeats (after one warm-up batch), and the last run's outputs."""
    engine.generate(batches[0][:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    engine.kv_manager.reset_prefix_cache()
    rates: list[float] = []
    outputs = []
    for _ in range(repeats):
        outputs = []
        start = time.perf_counter()
        for batch in batches:
            outputs += engine.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.token_ids or ()) for o in outputs) / elapsed)
        engine.kv_manager.reset_prefix_cache()  # every run prefills its prompts
    return statistics.median(rates), [list(o.token_ids or ()) for o in outputs]


def measure(
    args, method: str, k: int, prompts: list[str], reference: list[list[int]] | None
) -> tuple[dict[str, Any], list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_max_tokens)
    engine = _engine(args, method, k, max_num_seqs=1, max_batch=1)
    rate, tokens = _timed(engine, [[p] for p in prompts], params, args.spec_repeats)
    spec = engine.stats().spec_decode
    row: dict[str, Any] = {
        "method": method,
        "k": k if method != "none" else None,
        "batch1_tokens_per_s": rate,
        "output_tokens": sum(map(len, tokens)),
        "acceptance_rate": spec.acceptance_rate if method != "none" else None,
        "mean_accepted_length": spec.mean_accepted_length if method != "none" else None,
        "acceptance_per_position": [n / spec.num_drafts for n in spec.accepted_per_position]
        if spec.num_drafts
        else [],
        "identical_to_none": None if reference is None else tokens == reference,
    }
    del engine
    batch = (prompts * (args.spec_full_batch // len(prompts) + 1))[: args.spec_full_batch]
    full_batch = [batch]
    for label, max_batch in (
        ("full_batch", DEFAULT_SPECULATIVE_MAX_BATCH_SIZE),
        ("full_batch_forced", args.spec_full_batch),
    ):
        if method == "none" and label == "full_batch_forced":
            continue
        engine = _engine(args, method, k, max_num_seqs=args.spec_full_batch, max_batch=max_batch)
        row[f"{label}_tokens_per_s"], _ = _timed(engine, full_batch, params, args.spec_repeats)
        del engine
    return row, tokens


def run_speculation_report(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = corpus.sample_prompts(args.seed, args.spec_prompts)
    plan = [("none", 1)] + [("ngram", k) for k in args.spec_tokens]
    if args.draft_model:
        plan += [("draft", k) for k in args.spec_tokens]
    else:
        _progress("no --draft-model: n-gram only")
    rows, reference = [], None
    for i, (method, k) in enumerate(plan, 1):
        _progress(f"[{i}/{len(plan)}] {method}" + (f", K={k}" if method != "none" else "") + " ...")
        row, tokens = measure(args, method, k, prompts, reference)
        if reference is None:
            reference = tokens
        rows.append(row)
    none = rows[0]
    for row in rows:
        row["batch1_speedup"] = row["batch1_tokens_per_s"] / none["batch1_tokens_per_s"]
        row["full_batch_ratio"] = row["full_batch_tokens_per_s"] / none["full_batch_tokens_per_s"]
        if "full_batch_forced_tokens_per_s" in row:
            row["full_batch_forced_ratio"] = (
                row["full_batch_forced_tokens_per_s"] / none["full_batch_tokens_per_s"]
            )
    report = {
        "model": args.model,
        "draft_model": args.draft_model,
        "device": args.device,
        "threads": args.threads or torch.get_num_threads(),
        "prompts": len(prompts),
        "max_tokens": args.spec_max_tokens,
        "full_batch": args.spec_full_batch,
        "speculative_max_batch_size": DEFAULT_SPECULATIVE_MAX_BATCH_SIZE,
        "repeats": args.spec_repeats,
        "rows": rows,
    }
    report["verdicts"] = verdicts(report)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        _progress(f"wrote {args.json}")
    if args.png:
        plot(report, args.png)
        _progress(f"wrote {args.png}")
    return 0
