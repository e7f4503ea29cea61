"""`flotilla engine bench serve|offline|fair|gpu|lora`: the flags (argparse, and the flag helpers of the
benchmark modules, which import no torch at module level); the benchmarks load inside the command
functions. The root CLI attaches `configure` under `flotilla engine` when this distribution is installed."""

from __future__ import annotations

import argparse
import sys


def configure(bench: argparse.ArgumentParser) -> None:
    """Fills `flotilla engine bench`: one subcommand per benchmark."""
    from flotilla.bench.engine.compare_vllm_serve import add_compare_serve_args
    from flotilla.bench.engine.fair import add_bench_fair_args
    from flotilla.bench.engine.lora import add_bench_lora_args
    from flotilla.bench.engine.quantization import add_quantization_report_args
    from flotilla.bench.engine.serve import add_bench_serve_args
    from flotilla.bench.engine.speculation import add_speculation_report_args
    from flotilla.bench.engine.vllm_peer import add_vllm_args
    from flotilla.engine.engine_args import add_quantization_args, thread_count

    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    bench_serve = kinds.add_parser(
        "serve",
        help="load-test a running server: streamed requests, Poisson arrivals, latency percentiles",
        description="Stream requests to a running server and report TTFT, TPOT, ITL and end-to-end "
        "latency (mean, median, p90, p99), throughput and failed requests. With --compare vllm: start "
        "Flotilla's server and vLLM's, one at a time, and drive each with `vllm bench serve` and with this "
        "benchmark (docs/benchmarks.md).",
    )
    add_bench_serve_args(bench_serve)
    add_compare_serve_args(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)
    offline = kinds.add_parser(
        "offline",
        help="offline throughput against transformers, compute-limit ratio, KV utilization, prefix-cache TTFT, "
        "scheduler cost; or (--report) the quantization or speculation report",
        description="Offline benchmark on one model folder. Prints the figures; --json also writes them. "
        "--report throughput (the default) is the throughput benchmark; --report quantization measures "
        "every weight-only quantization (none, int8, int4 in each group size) on the model: layer bytes "
        "against bfloat16, perplexity on held-out corpus text, greedy agreement with the float model and "
        "decode tok/s; --report speculation the speculative decoding report. --compare vllm runs "
        "Flotilla and vLLM, each in its own process, on the same model, prompts and settings, in "
        "alternating rounds (docs/benchmarks.md).",
    )
    offline.add_argument("--model", required=True, help="model folder (e.g. from `flotilla model init`)")
    offline.add_argument(
        "--report",
        choices=["throughput", "quantization", "speculation"],
        default="throughput",
        help="which report (default throughput)",
    )
    offline.add_argument(
        "--png", help="quantization and speculation reports, --compare vllm: write their figure to this PNG"
    )
    offline.add_argument("--num-prompts", type=int, default=64)
    offline.add_argument("--input-len", default="32:256", help="prompt lengths, uniform in A:B tokens")
    offline.add_argument("--output-len", default="32:256", help="output lengths, uniform in A:B tokens")
    offline.add_argument(
        "--compare",
        choices=["hf", "vllm", "none"],
        default="none",
        help="also run transformers (hf), or compare with vLLM (vllm: needs --vllm-python; then only "
        "--num-prompts, the lengths, --seed, --dtype, --threads, the batch limits, --block-size and "
        "--kv-cache-memory are read)",
    )
    add_vllm_args(offline)
    offline.add_argument(
        "--hf-sequential-prompts",
        type=int,
        default=16,
        help="prompts for the one-at-a-time run (a rate; a subset keeps it short)",
    )
    offline.add_argument("--json", help="write the figures to this file")
    offline.add_argument(
        "--max-num-seqs", type=int, default=64, help="engine batch size, also transformers' static batch size"
    )
    offline.add_argument("--max-num-batched-tokens", type=int, default=2048)
    offline.add_argument("--block-size", type=int, default=16)
    offline.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    offline.add_argument(
        "--budget-sequences",
        type=int,
        default=16,
        help="KV budget for the fit figure, in max-length sequences",
    )
    offline.add_argument(
        "--prefix-requests", type=int, default=64, help="requests in the prefix scenario (0 skips it)"
    )
    offline.add_argument("--prefix-len", type=int, default=512)
    offline.add_argument("--device", default="auto")
    offline.add_argument("--dtype", default="auto")
    offline.add_argument("--seed", type=int, default=0)
    add_quantization_args(offline)
    offline.add_argument(
        "--threads", type=thread_count, default=0, help="torch CPU threads (0: torch's default)"
    )
    offline.add_argument(
        "--no-compute-limit",
        dest="compute_limit",
        action="store_false",
        help="skip the matmul rate, the compute-limit ratio and the step profile",
    )
    offline.add_argument(
        "--profile-steps",
        type=int,
        default=16,
        help="decode steps to profile for the step breakdown (0 skips the profile)",
    )
    offline.add_argument(
        "--no-profile", dest="profile_steps", action="store_const", const=0, help="same as --profile-steps 0"
    )
    add_quantization_report_args(offline)
    add_speculation_report_args(offline)
    offline.set_defaults(func=_bench_offline)
    lora = kinds.add_parser(
        "lora",
        help="LoRA adapters: a mixed batch over 1, 4 and 8 adapters against the base alone, memory per "
        "adapter, load to first token",
        description="Output tok/s of one batch on the base model and spread over N adapters (alternating "
        "rounds, ratios to the base), the memory per active adapter and the time from load to first token.",
    )
    add_bench_lora_args(lora)
    lora.set_defaults(func=_bench_lora)
    fair = kinds.add_parser(
        "fair",
        help="two tenants past capacity, one 10x the other: quiet tenant's TTFT, token shares, fcfs vs fair",
        description="Calibrate the engine's capacity, then send the same Poisson arrivals of a loud and a "
        "quiet tenant (past capacity) to a fresh engine per policy. Reports per-tenant TTFT p50/p95/p99, "
        "token shares, Jain's fairness index and throughput, and the fair-vs-fcfs targets (printed, not "
        "asserted). --json and --png also write them.",
    )
    add_bench_fair_args(fair)
    fair.set_defaults(func=_bench_fair)
    from flotilla.bench.engine.gpu import add_bench_gpu_args

    gpu = kinds.add_parser(
        "gpu",
        help="the GPU check: kernels vs reference, decode attention and batch-1 bandwidth vs copy, "
        "throughput vs transformers",
        description="On a CUDA machine, within ten minutes: the Triton kernels against the torch reference, "
        "decode attention bandwidth and batch-1 decode bandwidth utilisation (a random ~1B Llama in bf16) "
        "against the measured copy bandwidth, and throughput against transformers generate and "
        "generate_batch. Writes OUT/gpu-check.json (after every check) and OUT/gpu-check.png; targets are "
        "printed, not asserted. --quick --device cpu is a smoke run (TRITON_INTERPRET=1 runs the kernels).",
    )
    add_bench_gpu_args(gpu)
    gpu.set_defaults(func=_bench_gpu)


def _bench_lora(args: argparse.Namespace) -> int:
    from flotilla.bench.engine.lora import run_lora_bench

    return run_lora_bench(args)


def _bench_offline(args: argparse.Namespace) -> int:
    if args.compare == "vllm" or args.vllm_python:
        if args.report != "throughput":
            print("flotilla engine bench offline: --compare vllm is a throughput report", file=sys.stderr)
            return 2
        from flotilla.bench.engine.compare_vllm_offline import run_compare_offline

        return run_compare_offline(args)
    if args.report == "quantization":
        from flotilla.bench.engine.quantization import run_quantization_report

        return run_quantization_report(args)
    if args.report == "speculation":
        from flotilla.bench.engine.speculation import run_speculation_report

        return run_speculation_report(args)
    from flotilla.bench.engine.offline import run_offline

    return run_offline(args)


def _bench_fair(args: argparse.Namespace) -> int:
    from flotilla.bench.engine.fair import run_bench_fair

    return run_bench_fair(args)


def _bench_gpu(args: argparse.Namespace) -> int:
    from flotilla.bench.engine.gpu import run_bench_gpu

    return run_bench_gpu(args)


def _bench_serve(args: argparse.Namespace) -> int:
    if args.compare != "none" or args.vllm_python:
        from flotilla.bench.engine.compare_vllm_serve import run_compare_serve

        return run_compare_serve(args)
    from flotilla.bench.engine.serve import run_bench_serve

    return run_bench_serve(args)
