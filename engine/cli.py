"""`flotilla engine ...`. Import-light: torch and the engine load inside the command functions."""

from __future__ import annotations

import argparse


def add_commands(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark the engine")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    offline = kinds.add_parser(
        "offline",
        help="offline throughput against transformers, KV utilization, prefix-cache TTFT, scheduler cost",
        description="Offline benchmark on one model folder. Prints the figures; --json also writes them.",
    )
    offline.add_argument("--model", required=True, help="model folder (e.g. from `flotilla model init`)")
    offline.add_argument("--num-prompts", type=int, default=64)
    offline.add_argument("--input-len", default="32:256", help="prompt lengths, uniform in A:B tokens")
    offline.add_argument("--output-len", default="32:256", help="output lengths, uniform in A:B tokens")
    offline.add_argument("--compare", choices=["hf", "none"], default="none", help="also run transformers")
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
    offline.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    offline.add_argument("--seed", type=int, default=0)
    offline.set_defaults(func=_bench_offline)


def _bench_offline(args: argparse.Namespace) -> int:
    from flotilla.engine.bench import run_offline

    return run_offline(args)
