"""`flotilla engine bench serve --compare vllm --vllm-python PATH --model-dir DIR`: Flotilla's server against
vLLM's OpenAI server on the same model folder, cores, batch limits, KV budget and prefix caching. One server
at a time: each round (the order alternating) starts one, times its start-up (process start to /health
200), warms it, drives it with `vllm bench serve` (the peer's own client) and with Flotilla's `bench
serve` (the same prompt count and lengths, all greedy with ignore_eos), and stops it. Reports each client's
output tok/s, TTFT, TPOT and ITL p50/p95 per server and round, Flotilla/vLLM per round and its median
against the issue's targets, and start-up; prints them, writes --json and --plot. Asserts nothing."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from flotilla.bench.engine import compare_report, vllm_peer
from flotilla.bench.engine.peer_procs import Child, OtherLoad, PeerError, Server, free_port, progress
from flotilla.contract import CLI, ENGINE_KNOBS, EngineArgs, engine_serve_argv
from flotilla.engine.engine_args import parse_bytes, thread_count

COMMAND = "flotilla engine bench serve"
CLIENTS = ("vllm_bench_serve", "flotilla_bench_serve")
CLIENT_TIMEOUT_S = 3600.0


def add_compare_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "--compare vllm",
        "start Flotilla's server and vLLM's, one at a time, on the same model and settings, and drive each "
        "with `vllm bench serve` and with this benchmark (--url is not read)",
    )
    group.add_argument("--compare", choices=["none", vllm_peer.COMPARE_VLLM], default="none",
                       help="also run vLLM (default none: load-test the server at --url)")  # fmt: skip
    vllm_peer.add_vllm_args(group)
    group.add_argument("--model-dir", help="the model folder both servers load (required with --compare)")
    group.add_argument("--threads", type=thread_count, default=0,
                       help="cores for each server, both pinned to the same ones (0: all this process may use)")  # fmt: skip
    group.add_argument(
        "--dtype", default="auto", help="both servers' dtype (auto: Flotilla's choice, float32 on CPU)"
    )
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        knob = ENGINE_KNOBS[name]
        group.add_argument(
            knob.flag, type=int, default=knob.default, help=f"{knob.help}, both (default {knob.default})"
        )
    knob = ENGINE_KNOBS["block_size"]
    group.add_argument(
        knob.flag, type=int, default=knob.default,
        help=f"Flotilla's KV block size (default {knob.default}; vLLM's is {vllm_peer.FLAG_VLLM_BLOCK_SIZE})",
    )  # fmt: skip
    group.add_argument(ENGINE_KNOBS["kv_cache_memory"].flag, type=parse_bytes, default=None,
                       help=f"KV cache bytes, each (default {vllm_peer.KV_CACHE_BYTES >> 30} GiB)")  # fmt: skip
    group.add_argument("--startup-timeout", type=float, default=1800.0,
                       help="seconds a server may take to answer /health (default 1800: vLLM compiles)")  # fmt: skip


def flotilla_server_argv(settings: vllm_peer.Settings, served_name: str, port: int) -> list[str]:
    """`flotilla engine serve` by this interpreter, from the contract's builder, with the settings."""
    threads, seed = ENGINE_KNOBS["cpu_threads"].flag, ENGINE_KNOBS["seed"].flag
    engine = EngineArgs(
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size, kv_cache_memory=settings.kv_cache_bytes, dtype=settings.dtype,
        enable_prefix_caching=None if settings.prefix_caching else False,
        extra_args=(threads, str(settings.threads), seed, str(settings.seed)),
    )  # fmt: skip
    argv = engine_serve_argv(model_path=settings.model, served_name=served_name, host=vllm_peer.LOOPBACK,
                             port=port, shutdown_delay=0, drain_timeout=5, engine=engine)  # fmt: skip
    assert argv[0] == CLI
    return [sys.executable, "-m", "flotilla.cli", *argv[1:]]


def warm_up(url: str, served_name: str) -> None:
    """Two short requests, so that neither system's first-request costs fall in a measurement."""
    import httpx

    body = {"model": served_name, "prompt": [9, 10, 11, 12], "max_tokens": 8, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        for _ in range(2):
            client.post(f"{url}/v1/completions", json=body).raise_for_status()


def run_vllm_client(vllm_python: str, env: dict[str, str], server: Server, served_name: str, args,
                    settings: vllm_peer.Settings, workdir: Path, tag: str) -> dict[str, Any]:  # fmt: skip
    result_file = f"{tag}.json"
    argv = vllm_peer.bench_serve_argv(
        vllm_python, base_url=server.url, served_name=served_name, tokenizer=settings.model,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        result_dir=str(workdir), result_file=result_file, seed=args.seed, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
    )  # fmt: skip
    client = Child(f"vllm bench serve ({tag})", argv, workdir / f"{tag}.log", env, settings.cpus).start()
    assert client.proc is not None
    try:
        code = client.proc.wait(CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        client.stop()
        raise client.failure(f"took more than {CLIENT_TIMEOUT_S:.0f} s") from None
    if code != 0:
        raise client.failure(f"exited with code {code}")
    return compare_report.vllm_client_figures(json.loads((workdir / result_file).read_text()))


def run_flotilla_client(server: Server, served_name: str, args) -> dict[str, Any]:
    from flotilla.bench.engine.serve import run_benchmark

    summary, results = asyncio.run(
        run_benchmark(
            server.url, args.num_prompts, args.input_len, args.output_len, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, seed=args.seed, model=served_name,
            progress=not args.no_progress,
        )
    )  # fmt: skip
    return compare_report.flotilla_client_figures(summary, results)


def resolve_dtype(dtype: str, model: str) -> str:
    from flotilla.bench.engine.compare_vllm_offline import resolve_dtype as offline_dtype

    return offline_dtype(dtype, model)


def run_compare_serve(args: argparse.Namespace) -> int:
    try:
        vllm_python = vllm_peer.check_vllm_python(args.compare, args.vllm_python)
        assert vllm_python is not None
        if not args.model_dir:
            raise vllm_peer.CompareError(
                "--compare vllm needs --model-dir DIR: the model folder both servers load"
            )
        orders = compare_report.round_orders(args.rounds)
        settings = vllm_peer.namespace_settings(
            args, args.model_dir, resolve_dtype(args.dtype, args.model_dir), vllm_peer.cpus_for(args.threads)
        )
    except ValueError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    served_name = args.model or Path(settings.model).name
    tcmalloc = vllm_peer.find_tcmalloc(vllm_python)
    envs = {"flotilla": dict(os.environ), "vllm": vllm_peer.vllm_env(os.environ, settings, tcmalloc)}
    workdir = Path(tempfile.mkdtemp(prefix="flotilla-vs-vllm-serve-"))
    rounds: list[dict[str, Any]] = []
    try:
        from flotilla.bench.engine.compare_vllm_offline import vllm_versions

        progress(f"vllm: checking {vllm_python} ...")
        versions = vllm_versions(vllm_python, envs["vllm"])
        progress(f"vllm: {versions} (vLLM, torch); {args.num_prompts} prompts of {args.input_len} tokens, "
                 f"{args.output_len} out, {args.rounds} rounds, CPUs {list(settings.cpus)}")  # fmt: skip
        for number, order in enumerate(orders, 1):
            measured: dict[str, Any] = {"order": list(order)}
            for system in order:
                measured[system] = serve_one(system, number, len(orders), vllm_python, envs, settings,
                                             served_name, args, workdir)  # fmt: skip
            rounds.append(measured)
    except PeerError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        print(f"{COMMAND}: the logs are in {workdir}", file=sys.stderr)
        return 1
    report = build_report(args, settings, versions, tcmalloc, rounds)
    print_report(report)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=1) + "\n")
        progress(f"wrote {args.json_file}")
    if args.plot:
        from flotilla.bench.engine.compare_figures import plot_serve

        plot_serve(report, args.plot)
        progress(f"wrote {args.plot}")
    shutil.rmtree(workdir, ignore_errors=True)
    failed = any(
        r[s]["clients"][c]["failed"] for r in rounds for s in compare_report.SYSTEMS for c in CLIENTS
    )
    return 1 if failed else 0


def serve_one(system: str, number: int, total: int, vllm_python: str, envs: dict[str, dict[str, str]],
              settings: vllm_peer.Settings, served_name: str, args, workdir: Path) -> dict[str, Any]:  # fmt: skip
    """One server's part of a round: start-up, warm-up, both clients, stop."""
    port = free_port()
    if system == "vllm":
        argv = vllm_peer.server_argv(vllm_python, settings, served_name, port)
    else:
        argv = flotilla_server_argv(settings, served_name, port)
    tag = f"round{number}-{system}"
    server = Server(
        f"{system} server", argv, workdir / f"{tag}-server.log", envs[system], settings.cpus, port
    )
    progress(f"round {number}/{total}: starting the {system} server ...")
    server.start()
    try:
        startup_s = server.wait_healthy(args.startup_timeout)
        progress(f"round {number}: {system} server healthy in {startup_s:.1f} s; warming up")
        warm_up(server.url, served_name)
        clients: dict[str, Any] = {}
        for client in CLIENTS:
            server.wait_quiet()  # vLLM's worker spins for seconds after a batch
            progress(f"round {number}: {system} server, client {client} ({args.num_prompts} requests) ...")
            with OtherLoad([server], settings.cpus) as load:
                if client == "vllm_bench_serve":
                    figures = run_vllm_client(vllm_python, envs["vllm"], server, served_name, args, settings,
                                              workdir, f"{tag}-vllm-client")  # fmt: skip
                else:
                    figures = run_flotilla_client(server, served_name, args)
            clients[client] = figures = {**figures, "other_load_share": load.share}
            progress(f"round {number}: {system} server, {client}: {figures['output_tok_s']:.1f} output tok/s, "
                     f"{figures['failed']} failed; other work took {load.share:.0%} of its cores")  # fmt: skip
    except Exception as exc:
        if isinstance(exc, PeerError):
            raise
        raise server.failure(f"failed a request: {type(exc).__name__}: {exc}") from exc
    finally:
        server.stop()
    return {"startup_s": startup_s, "clients": clients}


def build_report(args, settings: vllm_peer.Settings, versions: str, tcmalloc: str | None,
                 rounds: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    vllm_version, _, vllm_torch = versions.partition(" ")
    startups = {s: [r[s]["startup_s"] for r in rounds] for s in compare_report.SYSTEMS}
    return {
        "comparison": "serve",
        "model": settings.model,
        "vllm_version": vllm_version,
        "vllm_torch": vllm_torch,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },  # fmt: skip
        "fairness": vllm_peer.fairness(settings, tcmalloc),
        "servers": {
            "flotilla": "flotilla engine serve (the engine loop on a thread of the server's process)",
            "vllm": f"python -m {vllm_peer.SERVER_MODULE} (vLLM's OpenAI server)",
        },
        "rounds": rounds,
        "startup_s": startups,
        "startup_ratio": compare_report.ratios(startups["flotilla"], startups["vllm"]),
        "ratios": {client: compare_report.serve_ratios(rounds, client) for client in CLIENTS},
    }


def print_report(r: dict[str, Any]) -> None:
    f, w = r["fairness"], r["workload"]
    print(f"flotilla vs vLLM {r['vllm_version']}, served: {r['model']}")
    rate = "all at once" if w["request_rate"] is None else f"{w['request_rate']} req/s"
    print(f"  {w['num_prompts']} prompts of {w['input_len']} tokens, {w['output_len']} out, {rate}, "
          f"max concurrency {w['max_concurrency'] or '-'}; greedy, ignore_eos")  # fmt: skip
    print(f"  {f['dtype']}, {f['threads']} threads: {f['binding']}")
    print(f"  max_num_seqs {f['max_num_seqs']}, max_num_batched_tokens {f['max_num_batched_tokens']}, "
          f"KV {f['kv_cache_bytes_each'] / 2**30:.2f} GiB each, prefix caching on for both, block sizes "
          f"flotilla {f['block_sizes']['flotilla']} / vllm {f['block_sizes']['vllm']}, preloads: vllm "
          f"{f['preloads']['vllm']}")  # fmt: skip
    header = f"  {'':<44}{'out tok/s':>10}" + "".join(f"{name:>10}" for _, name in compare_report.LATENCIES)
    for client in CLIENTS:
        print(f" client {client} (latencies in ms; other: the share of the cores other work took meanwhile):")
        print(header)
        for number, rnd in enumerate(r["rounds"], 1):
            for system in compare_report.SYSTEMS:
                fig = rnd[system]["clients"][client]
                cells = "".join(
                    f"{fig[key] * 1000:>10.1f}" if fig[key] is not None else f"{'-':>10}"
                    for key, _ in compare_report.LATENCIES
                )
                label = (
                    f"round {number} {system} ({fig['failed']} failed, other {fig['other_load_share']:.0%})"
                )
                print(f"  {label:<44}{fig['output_tok_s']:>10.1f}{cells}")
        ratios = r["ratios"][client]
        cells = "".join(
            f"{compare_report.fmt_ratio(ratios[k]['median']):>10}" for k, _ in compare_report.LATENCIES
        )
        print(
            f"  {'median flotilla/vllm':<44}{compare_report.fmt_ratio(ratios['output_tok_s']['median']):>10}{cells}"
        )
        verdicts = ", ".join(
            f"{key} {ratios[key]['verdict']}" for key in compare_report.TARGETS if ratios[key]["verdict"]
        )
        print(f"  targets (tok/s >= 1.25x, TTFT p95 and TPOT p50 <= 0.8x): {verdicts}")
    starts = ", ".join(
        f"{s} " + "/".join(f"{v:.1f}" for v in r["startup_s"][s]) + " s" for s in compare_report.SYSTEMS
    )
    print(f"  start-up (process start to /health 200, per round): {starts}")
