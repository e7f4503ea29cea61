"""`flotilla engine bench offline --report speculation`: speculative decoding against none, on one model.

For no speculation, n-gram lookup and (with --draft-model) the draft model, at each K in --spec-tokens:
- batch 1: the corpus prompts (`corpus.sample_prompts`, whose continuations copy names from the prompt)
  one at a time, greedy, up to --spec-max-tokens tokens each; output tok/s (the median of --spec-repeats
  runs after a warm-up), the acceptance rate, the mean accepted length (tokens per verifying step) and the
  acceptance per draft position; and whether the outputs are token for token those without speculation;
- a full batch: --spec-full-batch requests at once, as the engine runs by default (speculation turns
  itself off above --speculative-max-batch-size running requests), and with speculation forced on at
  that batch, which shows why it turns off.

The engines take turns round after round (a shared machine drifts by tens of percent over minutes).
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
from typing import TYPE_CHECKING

from flotilla.bench.engine.speculation_figures import format_report, plot, verdicts
from flotilla.contract import DEFAULT_SPECULATIVE_MAX_BATCH_SIZE
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.engine_args import positive_count, positive_counts
from flotilla.engine.model.synthetic import corpus

KV_CACHE_BYTES = 128 << 20

if TYPE_CHECKING:
    from flotilla.engine.llm_engine import LLMEngine


def add_speculation_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--report speculation", "speculative decoding against none on --model")
    group.add_argument(
        "--draft-model", help="the draft model's folder (same tokenizer); without it, n-gram only"
    )
    group.add_argument(
        "--spec-tokens",
        type=positive_counts,
        default=[2, 4],
        metavar="K,...",
        help="drafts per step to try (default 2,4)",
    )
    group.add_argument(
        "--spec-prompts", type=positive_count, default=24, metavar="N", help="corpus prompts (default 24)"
    )
    group.add_argument(
        "--spec-max-tokens",
        type=positive_count,
        default=128,
        metavar="N",
        help="most output tokens each (default 128)",
    )
    group.add_argument(
        "--spec-full-batch",
        type=positive_count,
        default=32,
        metavar="B",
        help="requests in the full batch (default 32)",
    )
    group.add_argument(
        "--spec-repeats", type=positive_count, default=3, metavar="N", help="runs per figure (default 3)"
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
            # Many engines live at once here; their KV caches need not be the CPU default of 1 GiB.
            kv_cache_memory=args.kv_cache_memory or KV_CACHE_BYTES,
            max_num_seqs=max_num_seqs,
            speculative_method=method,
            num_speculative_tokens=k,
            speculative_model=args.draft_model if method == "draft" else None,
            speculative_max_batch_size=max_batch,
        )
    )


def _run(
    engine: LLMEngine, batches: list[list[str]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    """Output tok/s over the batches (each run to completion in turn), and the outputs."""
    outputs = []
    start = time.perf_counter()
    for batch in batches:
        outputs += engine.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine.kv_manager.reset_prefix_cache()  # every run prefills its prompts
    return sum(len(o.token_ids or ()) for o in outputs) / elapsed, [list(o.token_ids or ()) for o in outputs]


def _interleaved(
    engines: list[LLMEngine], batches: list[list[str]], params: SamplingParams, repeats: int, what: str
):
    """Each engine's tok/s per round and last outputs. The engines take turns, round after round, so that a
    machine whose speed drifts (a shared one does, by tens of percent over minutes) slows them alike; a
    ratio between two engines is then the median of their per-round ratios (paired_ratio)."""
    for engine in engines:  # warm-up: first-touch page faults, allocator, caches
        engine.generate(batches[0][:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        engine.kv_manager.reset_prefix_cache()
    rates: list[list[float]] = [[] for _ in engines]
    outputs: list[list[list[int]]] = [[] for _ in engines]
    for round_ in range(repeats):
        _progress(f"  {what}: round {round_ + 1}/{repeats}")
        for i, engine in enumerate(engines):
            rate, outputs[i] = _run(engine, batches, params)
            rates[i].append(rate)
    return rates, outputs


def paired_ratio(rates: list[float], baseline: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(rates, baseline, strict=True))


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
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_max_tokens)

    _progress(f"batch 1: {len(plan)} engines, {len(prompts)} prompts one at a time")
    engines = [_engine(args, method, k, max_num_seqs=1, max_batch=1) for method, k in plan]
    rates, outputs = _interleaved(engines, [[p] for p in prompts], params, args.spec_repeats, "batch 1")
    rows = []
    for (method, k), engine, rate, tokens in zip(plan, engines, rates, outputs, strict=True):
        spec = engine.stats().spec_decode
        drafting = method != "none"
        rows.append(
            {
                "method": method,
                "k": k if drafting else None,
                "batch1_tokens_per_s": statistics.median(rate),
                "batch1_speedup": paired_ratio(rate, rates[0]),
                "output_tokens": sum(map(len, tokens)),
                "acceptance_rate": spec.acceptance_rate if drafting else None,
                "mean_accepted_length": spec.mean_accepted_length if drafting else None,
                "acceptance_per_position": [n / spec.num_drafts for n in spec.accepted_per_position]
                if spec.num_drafts
                else [],
                "identical_to_none": tokens == outputs[0] if drafting else None,
            }
        )
    del engines

    batch = (prompts * (args.spec_full_batch // len(prompts) + 1))[: args.spec_full_batch]
    full = args.spec_full_batch
    # As the engine runs by default (speculation off above the batch size), then forced on.
    full_plan = [(method, k, DEFAULT_SPECULATIVE_MAX_BATCH_SIZE, False) for method, k in plan]
    full_plan += [(method, k, full, True) for method, k in plan if method != "none"]
    _progress(f"batch {full}: {len(full_plan)} engines")
    engines = [_engine(args, method, k, max_num_seqs=full, max_batch=m) for method, k, m, _ in full_plan]
    rates, _ = _interleaved(engines, [batch], params, args.spec_repeats, f"batch {full}")
    del engines
    by_config = {(method, k): row for (method, k), row in zip(plan, rows, strict=True)}
    for (method, k, _max_batch, forced), rate in zip(full_plan, rates, strict=True):
        row = by_config[(method, k)]
        row["full_batch_forced_tokens_per_s" if forced else "full_batch_tokens_per_s"] = statistics.median(
            rate
        )
        row["full_batch_forced_ratio" if forced else "full_batch_ratio"] = paired_ratio(rate, rates[0])
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
