"""`flotilla engine bench offline --report quantization`: every weight-only quantization of one model (none,
int8, int4 with groups of 32, 64 and 128; a group size that does not divide the model's layers is skipped,
saying why), each in a fresh engine loaded the way `flotilla engine serve` loads it, and for each:

- bytes: the quantized layers' bytes (weights, scales and zeros: model/quantize.py's helpers) over the same
  weights in bfloat16, next to the issue's targets (int8 <= 0.55, int4 <= 0.30), and the whole model's;
- perplexity on held-out text of the trained presets' corpus (model/synthetic/corpus.py
  `held_out_documents`): each document as training saw it (`<s> tokens </s>`), one forward of the engine's
  own model over the whole sequence (prefill attention metadata over a KV cache of its own, so the
  engine's is left alone), the LM head on every row; exp of the mean negative log-likelihood of every
  token after the first;
- greedy agreement with the float model: `--agreement-tokens` greedy tokens (ignore_eos) for each of
  `--agreement-prompts` prompts (`corpus.sample_prompts`) through `LLMEngine.generate`, against the float
  engine's tokens for the same prompts: the share of positions that match before each prompt's first
  difference, and the mean matching prefix;
- decode speed: output tokens per second through `LLMEngine.generate` (greedy, ignore_eos,
  `--decode-tokens` tokens each) with `--decode-batch-sizes` requests at once (default 1 and 32), the
  median of `--decode-repeats` runs after a warm-up; `decode_tokens_per_s` in the JSON leaves the prompts'
  prefill out (tokens after each request's first over the first-to-last token time).

Meant for the trained preset (`flotilla model init --preset tiny-trained DIR`), whose perplexity and
agreement mean something; on random weights they are noise. Prints the table (progress on stderr), writes
--json and --png; asserts nothing. The prefix cache is off: repeated runs would otherwise skip prefill."""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flotilla.bench.engine.quantization_figures import (
    bytes_verdict,
    format_report,
    greedy_agreement,
    method_name,
    plot,
)
from flotilla.bench.engine.setup import json_safe
from flotilla.contract import DEFAULT_QUANTIZATION_GROUP_SIZE, QUANTIZATION_GROUP_SIZES
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.engine_args import positive_count, positive_counts
from flotilla.engine.model.config import ModelConfig, check_quantization
from flotilla.engine.model.synthetic import corpus
from flotilla.engine.model.synthetic.presets import CORPUS_SEED, TRAINING_RECORD

if TYPE_CHECKING:
    import torch

    from flotilla.engine.llm_engine import LLMEngine
    from flotilla.engine.worker.model_runner import ModelRunner

LOGIT_ROWS = 512  # rows of logits at a time: a long document over a large vocabulary stays small


def add_quantization_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "--report quantization", "every method on --model; --quantization and its group size are ignored"
    )
    group.add_argument(
        "--perplexity-documents",
        type=positive_count,
        default=300,
        metavar="N",
        help="held-out corpus documents for perplexity (default 300, the trained presets' held-out set)",
    )
    group.add_argument(
        "--agreement-prompts",
        type=positive_count,
        default=32,
        metavar="N",
        help="corpus prompts for greedy agreement with the float model (default 32)",
    )
    group.add_argument(
        "--agreement-tokens",
        type=positive_count,
        default=128,
        metavar="N",
        help="greedy tokens per prompt (default 128)",
    )
    group.add_argument(
        "--decode-batch-sizes",
        type=positive_counts,
        default=[1, 32],
        metavar="B,...",
        help="requests at once in the decode speed runs, comma-separated (default 1,32)",
    )
    group.add_argument(
        "--decode-tokens",
        type=positive_count,
        default=128,
        metavar="N",
        help="output tokens per request in the decode speed runs (default 128)",
    )
    group.add_argument(
        "--decode-repeats",
        type=positive_count,
        default=3,
        metavar="N",
        help="timed runs per batch size, median (default 3)",
    )


# -- what runs -------------------------------------------------------------------------------------------
def plan_methods(config: ModelConfig) -> list[tuple[str, int | None, str | None]]:
    """(quantization, int4 group size or None, why it is skipped or None), the float model first."""
    methods: list[tuple[str, int | None, str | None]] = [("none", None, None), ("int8", None, None)]
    for group in QUANTIZATION_GROUP_SIZES:
        try:
            check_quantization(config, "int4", group)
            reason = None
        except ValueError as exc:
            reason = str(exc)
        methods.append(("int4", group, reason))
    return methods


def make_engine(args: argparse.Namespace, quantization: str, group: int | None) -> LLMEngine:
    from flotilla.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            # The speed runs need every request of the largest batch running at once.
            max_num_seqs=max(args.max_num_seqs, *args.decode_batch_sizes),
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=False, show_progress=False, cpu_threads=args.threads, seed=args.seed,
            quantization=quantization, quantization_group_size=group or DEFAULT_QUANTIZATION_GROUP_SIZE,
        )
    )  # fmt: skip


# -- bytes -----------------------------------------------------------------------------------------------
def layer_bytes(engine: LLMEngine) -> dict[str, Any]:
    """The quantizable layers' bytes against the same weights in bfloat16 (the float model: their float
    bytes), and the whole model's weights against the model in bfloat16."""
    import torch

    from flotilla.bench.engine.offline import quantized_layer_bytes

    info = engine.model_info
    if info.quantization == "none":
        cfg = engine.model_config
        elements = cfg.num_hidden_layers * sum(k * n for _, k, n in cfg.decoder_linears())
        ours, bf16 = elements * torch.finfo(engine.runner.dtype).bits // 8, 2 * elements
    else:
        measured = quantized_layer_bytes(engine)
        ours, bf16 = measured["quantized_layers_bytes"], measured["quantized_layers_bf16_bytes"]
    ratio = ours / bf16 if bf16 else None
    return {
        "layers_bytes": ours,
        "layers_bf16_bytes": bf16,
        "layers_bf16_ratio": ratio,
        **bytes_verdict(info.quantization, ratio),
        "weight_bytes": info.weight_bytes,
        "bf16_weight_bytes": info.bf16_weight_bytes,
        "weight_bf16_ratio": info.weight_bytes / info.bf16_weight_bytes if info.bf16_weight_bytes else None,
    }


# -- perplexity ------------------------------------------------------------------------------------------
def document_ids(engine: LLMEngine, text: str) -> list[int]:
    """A document as training packed it: `<s> tokens </s>` (no `<s>` where the tokenizer has none), cut to
    the engine's context."""
    tok = engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return ids[: engine.max_model_len]


def sequence_nll(runner: ModelRunner, ids: Sequence[int]) -> float:
    """The summed negative log-likelihood (nats) of ids[1:], each given the ones before it: one forward of
    the runner's model over the whole sequence as a single prefill, into a KV cache of its own."""
    import torch
    import torch.nn.functional as F

    from flotilla.engine.kernels.attention import AttentionMetadata

    n, block, dev = len(ids), runner.block_size, runner.device
    cfg = runner.model_config
    blocks = -(-n // block)
    shape = (blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=runner.dtype, device=dev),
            torch.zeros(shape, dtype=runner.dtype, device=dev),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        query_start=[0, n],
        context_lens=[0],
        seq_lens=[n],
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
        seq_lens_tensor=torch.tensor([n], dtype=torch.int32, device=dev),
        decode_requests=[],
        prefill_requests=[0],
        decode_token_index=torch.zeros(0, dtype=torch.long, device=dev),
    )
    tokens = torch.tensor(list(ids), dtype=torch.long, device=dev)
    with torch.inference_mode():
        hidden = runner.model(tokens, torch.arange(n, device=dev), caches, meta, runner.backend)
        total = 0.0
        for start in range(0, n - 1, LOGIT_ROWS):
            end = min(start + LOGIT_ROWS, n - 1)
            logits: torch.Tensor = runner.model.compute_logits(hidden[start:end])
            total += float(F.cross_entropy(logits, tokens[start + 1 : end + 1], reduction="sum"))
    return total


def perplexity(engine: LLMEngine, documents: Sequence[str]) -> dict[str, Any]:
    nll, scored = 0.0, 0
    for text in documents:
        ids = document_ids(engine, text)
        if len(ids) < 2:
            continue
        nll += sequence_nll(engine.runner, ids)
        scored += len(ids) - 1
    mean = nll / scored if scored else math.nan
    return {
        "documents": len(documents),
        "tokens": scored,
        "nll_per_token": mean,
        "perplexity": math.exp(mean) if math.isfinite(mean) else math.nan,
    }


# -- generation ------------------------------------------------------------------------------------------
def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def greedy_tokens(engine: LLMEngine, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    return [o.token_ids or [] for o in engine.generate(prompts, greedy(max_tokens), use_tqdm=False)]


def decode_speed(engine: LLMEngine, prompts: Sequence[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    """len(prompts) requests at once, `max_tokens` greedy tokens each: output tok/s through generate (the
    median of `repeats` runs after a warm-up), and the same runs' rate after every request's first token."""
    engine.generate(prompts, greedy(2), use_tqdm=False)  # warm-up
    rates, decode_rates, seconds, produced = [], [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, greedy(max_tokens), use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(o.num_output_tokens for o in outs)
        rates.append(produced / elapsed)
        seconds.append(elapsed)
        firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
        lasts = [o.last_token_time for o in outs if o.last_token_time is not None]
        span = max(lasts) - min(firsts) if firsts and lasts else 0.0
        if span > 0:
            decode_rates.append((produced - len(outs)) / span)
    return {
        "batch_size": len(prompts),
        "output_tokens": produced,  # every run's: ignore_eos
        "runs": repeats,
        "tokens_per_s": statistics.median(rates),
        "decode_tokens_per_s": statistics.median(decode_rates) if decode_rates else None,
        "seconds": statistics.median(seconds),
        "tokens_per_s_runs": rates,
    }


# -- the report ------------------------------------------------------------------------------------------
def measure(
    engine: LLMEngine,
    args: argparse.Namespace,
    documents: Sequence[str],
    reference: list[list[int]] | None,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], list[list[int]]]:
    """One method's figures, and its greedy tokens (the float model's are the reference)."""
    row: dict[str, Any] = {"bytes": layer_bytes(engine)}
    started = time.perf_counter()
    row["perplexity"] = perplexity(engine, documents)
    log(f"  perplexity {row['perplexity']['perplexity']:.3f} ({time.perf_counter() - started:.1f} s)")
    started = time.perf_counter()
    prompts = corpus.sample_prompts(CORPUS_SEED, args.agreement_prompts)
    tokens = greedy_tokens(engine, prompts, args.agreement_tokens)
    row["agreement"] = greedy_agreement(tokens if reference is None else reference, tokens)
    row["agreement"]["reference"] = reference is None
    log(
        f"  greedy agreement {row['agreement']['fraction_until_divergence']:.3f}, mean matching prefix "
        f"{row['agreement']['mean_matching_prefix']:.1f} tokens ({time.perf_counter() - started:.1f} s)"
    )
    row["decode"] = {}
    for batch in args.decode_batch_sizes:
        started = time.perf_counter()
        speed = decode_speed(
            engine, corpus.sample_prompts(CORPUS_SEED, batch), args.decode_tokens, args.decode_repeats
        )
        row["decode"][str(batch)] = speed
        log(
            f"  decode at batch {batch}: {speed['tokens_per_s']:.1f} output tok/s "
            f"({time.perf_counter() - started:.1f} s)"
        )
    return row, tokens


def training_record(model: str) -> dict[str, Any] | None:
    path = Path(model) / TRAINING_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def run_quantization_report(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    config = ModelConfig.from_file(Path(args.model) / "config.json")
    documents = corpus.held_out_documents(CORPUS_SEED, args.perplexity_documents)
    plan = plan_methods(config)
    measured = sum(reason is None for _, _, reason in plan)
    report: dict[str, Any] = {
        "report": "quantization",
        "model": str(Path(args.model).resolve()),
        "model_name": Path(args.model).resolve().name,
        "sizes": {
            "perplexity_documents": len(documents),
            "agreement_prompts": args.agreement_prompts,
            "agreement_tokens": args.agreement_tokens,
            "decode_batch_sizes": list(args.decode_batch_sizes),
            "decode_tokens": args.decode_tokens,
            "decode_repeats": args.decode_repeats,
        },
        "device": None,
        "dtype": None,
        "threads": None,
        "corpus_version": corpus.CORPUS_VERSION,
        "corpus_seed": CORPUS_SEED,
        "training_held_out_loss": None,
        "perplexity_tokens": None,
        "methods": [],
    }
    record = training_record(args.model)
    if record is not None:
        report["training_held_out_loss"] = record.get("held_out_loss")
    reference: list[list[int]] | None = None
    done = 0
    for quantization, group, reason in plan:
        name = method_name(quantization, group)
        if reason is not None:
            log(f"bench quantization: {name}: skipped: {reason}")
            report["methods"].append(
                {"name": name, "quantization": quantization, "group_size": group, "skipped": reason}
            )
            continue
        done += 1
        log(f"bench quantization: [{done}/{measured}] {name}: loading {args.model} ...")
        started = time.perf_counter()
        engine = make_engine(args, quantization, group)
        load_seconds = time.perf_counter() - started
        log(f"  loaded in {load_seconds:.1f} s: {engine.model_info.describe()}")
        if report["device"] is None:
            report.update(
                device=str(engine.runner.device),
                dtype=str(engine.runner.dtype).removeprefix("torch."),
                threads=torch.get_num_threads(),
            )
        row, tokens = measure(engine, args, documents, reference, log)
        if reference is None:
            reference = tokens
            report["perplexity_tokens"] = row["perplexity"]["tokens"]
        report["methods"].append(
            {
                "name": name,
                "quantization": quantization,
                "group_size": group,
                "skipped": None,
                "kernels": engine.model_info.kernels,
                "load_seconds": load_seconds,
                **row,
            }
        )
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    report = json_safe(report)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"bench quantization: wrote {args.json}")
    if args.png:
        plot(report, args.png)
        log(f"bench quantization: wrote {args.png}")
    return 0
