"""`flotilla engine bench offline`: throughput against transformers, the compute-limit ratio and a step's
breakdown (compute_limit.py), KV-slot utilization, sequences per KV budget, prefix-cache TTFT and the
scheduler's cost per step. Prints figures; asserts nothing.

Throughput (`tokens_per_s`) counts output tokens only, here and in the compute-limit ratio."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.bench.engine.setup import engine_header
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.kv_cache_manager import KVCacheManager, cdiv
from flotilla.engine.core.request import Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"expected a range like 32:256, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"range {text!r} must satisfy 1 <= A <= B")
    return low, high


def make_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # Avoid the low ids, where the presets keep their special tokens.
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


# -- runs ----------------------------------------------------------------------------------------------
def run_engine(engine, work: Workload) -> dict[str, Any]:
    """Continuous batching over the whole workload; also samples KV-slot utilization every step."""
    for prompt, out_len in zip(work.prompts, work.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    max_seqs = engine.config.max_num_seqs
    bs = engine.config.block_size
    held_full, slots_full, held_all, slots_all = 0, 0, 0, 0
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        running = engine.scheduler.running
        held = sum(r.num_computed_tokens for r in running)
        slots = sum(len(r.block_ids) for r in running) * bs
        held_all, slots_all = held_all + held, slots_all + slots
        if len(running) >= max_seqs:  # steady state: the batch is full
            held_full, slots_full = held_full + held, slots_full + slots
    elapsed = time.perf_counter() - start
    util = held_full / slots_full if slots_full else (held_all / slots_all if slots_all else 0.0)
    return {
        "seconds": elapsed,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "kv_slot_utilization": util,
        "kv_slot_utilization_measured_at": "full batch" if slots_full else "all steps",
    }


def hf_sequential(model, work: Workload) -> dict[str, Any]:
    """One request at a time: batches of one need no padding, so each runs exactly its own length."""
    result = hf_static_batches(model, work, 1)
    del result["batch_size"]
    return result


def hf_static_batches(model, work: Workload, batch_size: int) -> dict[str, Any]:
    """Padded batches in arrival order; a batch runs until its longest output is done. Only each
    request's own output tokens count."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[i : i + batch_size]
            longest = max(map(len, prompts))
            ids = torch.zeros(len(prompts), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(prompts):  # left padding
                ids[row, longest - len(p) :] = torch.tensor(p)
                mask[row, longest - len(p) :] = 1
            steps = max(work.output_lens[i : i + batch_size])
            model.generate(
                ids.to(model.device),  # on the model's device: on CUDA, no copy per step
                attention_mask=mask.to(model.device),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=0,
            )
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "output_tokens": work.output_tokens,
        "tokens_per_s": work.output_tokens / elapsed,
        "batch_size": batch_size,
    }


def prefix_ttft(make_engine, vocab: int, num_requests: int, prefix_len: int, seed: int) -> dict[str, Any]:
    """A burst of requests sharing one system prompt, each with its own question; TTFT with prefix
    caching and without (the same engine settings otherwise)."""
    rng = random.Random(seed + 1)
    system = [rng.randrange(8, vocab) for _ in range(prefix_len)]
    prompts = [
        system + [rng.randrange(8, vocab) for _ in range(rng.randint(16, 48))] for _ in range(num_requests)
    ]
    result: dict[str, Any] = {"requests": num_requests, "shared_prefix_tokens": prefix_len}
    for caching in (True, False):
        engine = make_engine(caching)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.generate([[9, 10, 11]], params, use_tqdm=False)  # warm-up
        arrival = time.time()
        for p in prompts:
            engine.add_request(p, params, arrival_time=arrival)
        ttfts = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.num_output_tokens == 1:
                    ttfts.append(out.first_token_time - out.arrival_time)
        key = "with_cache" if caching else "without_cache"
        stats = engine.stats()
        result[key] = {
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts),
            "prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else 0.0,
        }
    result["ttft_mean_ratio"] = result["without_cache"]["ttft_mean_s"] / result["with_cache"]["ttft_mean_s"]
    return result


def sequences_per_budget(
    work: Workload, block_size: int, budget_tokens: int, max_model_len: int
) -> dict[str, Any]:
    """How many of the workload's sequences run at once in a fixed KV budget: measured with the real
    scheduler and block manager (fake tokens, no model), against reserving max_model_len per sequence."""
    num_blocks = budget_tokens // block_size
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=100_000, max_num_batched_tokens=1 << 30, max_model_len=max_model_len), kv
    )
    for i, (p, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        sched.add_request(Request(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
    peak, counts = 0, []
    while sched.has_unfinished():
        out = sched.schedule()
        peak = max(peak, sched.num_running)
        counts.append(sched.num_running)
        sched.update_from_output(out, {s.request.request_id: [1] for s in out.scheduled if s.samples})
    return {
        "sequences_offered": len(work.prompts),
        "kv_budget_tokens": num_blocks * block_size,
        "paged_peak_concurrent_sequences": peak,
        # Mean over the middle half of the run (the budget is full there; start and drain excluded).
        "paged_mean_concurrent_sequences": statistics.fmean(
            counts[len(counts) // 4 : 3 * len(counts) // 4] or counts
        ),
        "contiguous_max_len_sequences": (num_blocks * block_size) // max_model_len,
        "preemptions": sched.num_preemptions,
    }


def scheduler_step_cost(
    num_seqs: int = 256, prompt_len: int = 128, steps: int = 200, block_size: int = 16
) -> dict[str, Any]:
    """Milliseconds per step of schedule() + update_from_output() with num_seqs decoding sequences."""
    kv = KVCacheManager(num_seqs * cdiv(prompt_len + steps + 8, block_size) + 8, block_size)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20, max_model_len=4096), kv
    )
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(8, 8000) for _ in range(prompt_len)]
        sched.add_request(Request(f"b{i}", prompt, SamplingParams(max_tokens=steps + 5, ignore_eos=True)))
    out = sched.schedule()  # prefill all
    sched.update_from_output(out, {s.request.request_id: [1] for s in out.scheduled if s.samples})
    assert sched.num_running == num_seqs
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: [8 + step] for s in out.scheduled})
        times.append(time.perf_counter() - t0)
    # The median resists other processes taking the CPU mid-step on a shared machine.
    return {
        "running_sequences": num_seqs,
        "steps": steps,
        "ms_per_step": statistics.median(times) * 1e3,
        "ms_per_step_mean": statistics.fmean(times) * 1e3,
    }


def measure_compute_limit(engine, work: Workload, run: dict[str, Any]) -> dict[str, Any]:
    """The matmul rate of the engine's own linear layers (its dtype, the run's threads) and the run's
    output tokens per second against the limit it sets (compute_limit.py says what counts)."""
    from flotilla.bench.engine.compute_limit import (
        compute_limit,
        mean_decode_context,
        measure_matmul,
        model_linears,
    )

    cfg = engine.model_config
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    matmul = measure_matmul(model_linears(engine.runner.model, cfg), log=log)
    context = mean_decode_context(map(len, work.prompts), work.output_lens)
    return compute_limit(cfg, matmul, run, sum(map(len, work.prompts)), context)


def quantized_layer_bytes(engine) -> dict[str, Any]:
    """The quantized layers' bytes (weights, scales, zeros) against the same weights in bfloat16."""
    from flotilla.engine.model.quantize import bf16_weight_bytes, quantized_weight_bytes

    model = engine.runner.model
    ours, bf16 = quantized_weight_bytes(model), bf16_weight_bytes(model, quantized_only=True)
    return {
        "quantized_layers_bytes": ours,
        "quantized_layers_bf16_bytes": bf16,
        "quantized_layers_bf16_ratio": ours / bf16 if bf16 else None,
        "weight_bf16_ratio": engine.model_info.weight_bytes / engine.model_info.bf16_weight_bytes,
    }


# -- the command ------------------------------------------------------------------------------------------
def run_offline(args) -> int:
    import torch

    from flotilla.bench.engine.compute_limit import profile_steps
    from flotilla.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads) if args.threads else None
    input_len = parse_range(args.input_len)
    output_len = parse_range(args.output_len)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    def make_engine(prefix_caching: bool = True) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=prefix_caching, show_progress=False,
                cpu_threads=args.threads, quantization=args.quantization,
                quantization_group_size=args.quantization_group_size,
            )
        )  # fmt: skip

    engine = make_engine()
    vocab = engine.model_config.vocab_size
    work = make_workload(args.num_prompts, input_len, output_len, vocab, args.seed)
    report: dict[str, Any] = {
        **engine_header(args, engine, input_len, output_len),
        "num_prompts": args.num_prompts,
        **quantized_layer_bytes(engine),
    }
    log(
        f"bench: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, on {report['device']}"
    )
    engine.generate(
        [[9, 10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    log("bench: (c) flotilla ...")
    report["flotilla"] = run_engine(engine, work)
    if args.compute_limit:
        report["compute_limit"] = measure_compute_limit(engine, work, report["flotilla"])
        if args.profile_steps > 0:
            log(f"bench: profiling {args.profile_steps} decode steps ...")
            report["step_breakdown"] = profile_steps(
                engine, work.prompts, work.output_lens, args.profile_steps
            )

    if args.compare == "hf":
        import transformers

        model = (
            transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.runner.dtype)
            .to(engine.runner.device)
            .eval()
        )
        model.generation_config.eos_token_id = None
        warm = Workload([[9, 10, 11, 12]], [4])
        hf_sequential(model, warm)
        subset = Workload(
            work.prompts[: args.hf_sequential_prompts], work.output_lens[: args.hf_sequential_prompts]
        )
        log(f"bench: (a) transformers, one request at a time ({len(subset.prompts)} prompts) ...")
        report["hf_sequential"] = hf_sequential(model, subset)
        report["hf_sequential"]["prompts_measured"] = len(subset.prompts)
        log(f"bench: (b) transformers, static batches of {args.max_num_seqs} ...")
        report["hf_static_batch"] = hf_static_batches(model, work, args.max_num_seqs)
        ours = report["flotilla"]["tokens_per_s"]
        report["speedup_vs_hf_sequential"] = ours / report["hf_sequential"]["tokens_per_s"]
        report["speedup_vs_hf_static_batch"] = ours / report["hf_static_batch"]["tokens_per_s"]
        del model

    budget_tokens = args.budget_sequences * engine.max_model_len
    # Enough sequences (same length ranges) to fill the budget, so the figure is not capped by --num-prompts.
    population = make_workload(2048, input_len, output_len, vocab, args.seed + 2)
    report["sequences_per_kv_budget"] = sequences_per_budget(
        population, args.block_size, budget_tokens, engine.max_model_len
    )
    del engine
    if args.prefix_requests > 0:
        log(f"bench: prefix scenario ({args.prefix_requests} requests sharing {args.prefix_len} tokens) ...")
        report["prefix_cache"] = prefix_ttft(
            make_engine, vocab, args.prefix_requests, args.prefix_len, args.seed
        )
    log("bench: scheduler cost per step ...")
    report["scheduler"] = scheduler_step_cost(num_seqs=256)

    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"bench: wrote {args.json}")
    return 0


def print_report(r: dict[str, Any]) -> None:
    print(f"model {r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads)")
    print(
        f"{r['num_prompts']} prompts, input {r['input_len']}, output {r['output_len']}, max_num_seqs {r['max_num_seqs']}"
    )
    print_weights(r)
    rows = [("(c) flotilla", r["flotilla"])]
    if "hf_sequential" in r:
        rows = [
            (
                f"(a) transformers, one at a time ({r['hf_sequential']['prompts_measured']} prompts)",
                r["hf_sequential"],
            ),
            (
                f"(b) transformers, static batches of {r['hf_static_batch']['batch_size']}",
                r["hf_static_batch"],
            ),
        ] + rows
    for name, run in rows:
        print(
            f"  {name:<58} {run['tokens_per_s']:>9.1f} output tok/s  ({run['output_tokens']} tokens, {run['seconds']:.1f} s)"
        )
    if "speedup_vs_hf_sequential" in r:
        print(
            f"  flotilla / (a): {r['speedup_vs_hf_sequential']:.1f}x    flotilla / (b): {r['speedup_vs_hf_static_batch']:.2f}x"
        )
    if "compute_limit" in r:
        print_compute_limit(r["compute_limit"], r.get("step_breakdown"))
    f = r["flotilla"]
    print(f"KV-slot utilization ({f['kv_slot_utilization_measured_at']}): {f['kv_slot_utilization']:.3f}")
    s = r["sequences_per_kv_budget"]
    print(
        f"sequences at once in {s['kv_budget_tokens']} KV tokens: paged {s['paged_mean_concurrent_sequences']:.0f} "
        f"(peak {s['paged_peak_concurrent_sequences']}), "
        f"contiguous at max length {s['contiguous_max_len_sequences']}"
    )
    if "prefix_cache" in r:
        p = r["prefix_cache"]
        print(
            f"prefix cache, {p['requests']} requests sharing {p['shared_prefix_tokens']} tokens: mean TTFT "
            f"{p['with_cache']['ttft_mean_s'] * 1e3:.0f} ms with, {p['without_cache']['ttft_mean_s'] * 1e3:.0f} ms without "
            f"({p['ttft_mean_ratio']:.1f}x; hit rate {p['with_cache']['prefix_cache_hit_rate']:.2f})"
        )
    c = r["scheduler"]
    print(
        f"scheduler + block bookkeeping at {c['running_sequences']} running: {c['ms_per_step']:.3f} ms/step "
        f"(median; mean {c['ms_per_step_mean']:.3f})"
    )


def print_weights(r: dict[str, Any]) -> None:
    method = r["quantization"]
    if r["quantization_group_size"] is not None:
        method += f" (group size {r['quantization_group_size']})"
    line = (
        f"weights: {method}, {r['weight_bytes'] / 2**20:.2f} MiB = {r['weight_bf16_ratio']:.3f}x of the "
        f"model in bfloat16 ({r['bf16_weight_bytes'] / 2**20:.2f} MiB)"
    )
    if r["quantized_layers_bf16_ratio"] is not None:
        kernels = ", ".join(f"{k} ({n})" for k, n in sorted(r["quantized_layer_kernels"].items()))
        line += (
            f"; the quantized layers {r['quantized_layers_bytes'] / 2**20:.2f} MiB with their scales = "
            f"{r['quantized_layers_bf16_ratio']:.3f}x of their bfloat16 bytes, computed by {kernels}"
        )
    print(line)


def print_compute_limit(c: dict[str, Any], b: dict[str, Any] | None) -> None:
    print(
        f"compute limit: {c['model_flops_per_token'] / 1e6:.1f} MFLOP/token in linear layers (attention adds "
        f"{c['attention_flops_per_token'] / 1e6:.1f} at the mean context of {c['mean_decode_context']:.0f}); "
        f"matmul {c['matmul_gflops']:.1f} GFLOP/s ({c['matmul_batch_tokens']} tokens, {c['threads']} threads, "
        f"{c['dtype']})"
    )
    print(
        f"  limit {c['compute_limit_tokens_per_s']:.0f} output tok/s; (c) ran {c['tokens_per_s']:.1f} = "
        f"{c['compute_limit_ratio']:.3f} of it (with prompt tokens, linear FLOPs at "
        f"{c['linear_flops_utilization']:.3f} of the matmul rate)"
    )
    if b:
        names = {"linear": "linear", "attention": "attention", "sampling": "sampling",
                 "other_ops": "other ops", "python": "python/other"}  # fmt: skip
        shares = ", ".join(f"{names[k]} {v:.0%}" for k, v in b["shares"].items())
        print(
            f"  step breakdown ({b['steps']} decode steps at {b['running_sequences']} running, "
            f"{b['ms_per_step']:.1f} ms/step profiled): {shares}"
        )
