"""`flotilla gateway bench overhead`: what the gateway costs a request, and how many it can pass on a core,
for each data plane (`--data-plane`): the Python relay (`flotilla gateway run`'s HTTP port) and Envoy in
front of the endpoint picker (`flotilla gateway run --picker-port` answering Envoy's ext_proc and EDS, Envoy
on the bootstrap `flotilla gateway envoy-config` prints). `both` (the default) measures them side by side.

1. Added latency. One engine (one torch thread), behind each data plane with `--static-model`. The same
   small non-streaming completion (a short prompt, max_tokens 1) is sent sequentially `--requests` times
   straight to the engine and as many times through each data plane, in blocks of `--block` taking turns
   (the order rotating each round), so that drift in the machine's load hits all alike. The added latency
   is a data plane's percentile minus the direct one, per percentile; the targets: Envoy + picker p50 <= 1
   ms and p99 <= 5 ms, the relay p50 <= `--target-ms` (information). Each gateway's own figure (its
   added-latency histogram: arrival to upstream send, mean) is reported beside it. The same again in front
   of a stub upstream that answers at once.
2. Throughput ceiling on one core. The relay, and Envoy (`--concurrency 1`) with the picker's process,
   each pinned to the same CPU (os.sched_setaffinity in the child), in front of a stub upstream that answers
   at once (stub.py; the engine would be the bottleneck); `--concurrency` closed-loop clients on their own
   keep-alive connections for `--duration` seconds: requests/s, each pinned process's share of the core
   (its CPU time over the loop), and Envoy + picker's requests/s over the relay's against the target
   (>= 5x). The client and the stub run on the other CPUs; the same loop straight to the
   stub shows the ceiling of the client and stub themselves, which must be well above a data plane's for
   the figure to be the data plane's (the report warns when it is not).

Both use a minimal HTTP client (rawhttp.py) so the client's own cost stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.bench.gateway.bounds import bound_config, build_null_picker, null_picker_proc
from flotilla.bench.gateway.figures import (
    BOUND_PLANES,
    DATA_PLANE_NAMES,
    ENVOY_ALONE,
    ceiling_comparison,
    cpu_shares,
    data_planes,
    distribution,
    format_overhead,
    json_safe,
    latency_summary,
    ratio,
    sample_sum,
    throughput_summary,
)
from flotilla.bench.gateway.procs import (
    HOST,
    Proc,
    StartupError,
    available_cpus,
    cpu_seconds,
    engine_argv,
    ensure_model,
    envoy_proc,
    free_ports,
    gateway_argv,
    get_text,
    progress,
    stop_all,
    wait_healthy,
)
from flotilla.bench.gateway.rawhttp import Connection, HTTPError
from flotilla.contract import FLAG_PORT, GATEWAY_ADDED_LATENCY, METRICS_PATH, OPENAI_PATH

ENGINE_MODEL, STUB_MODEL = "tiny", "stub"
PROMPT = "Hello, my name is"
COMPLETIONS = OPENAI_PATH + "/completions"
WARMUP_REQUESTS = 10
WARMUP_SECONDS = 1.0
STUB_DIRECT_SECONDS = 3.0
ENVOY_CONCURRENCY = 1  # Envoy's worker threads: one core's worth


@dataclass
class Front:
    """Where clients send for one data plane, the gateway process whose /metrics counts its picks, and the
    processes pinned to the data plane's CPU (whose CPU time the throughput run reads)."""

    plane: str
    port: int
    metrics_url: str | None  # None: no Flotilla gateway behind it (the bounds)
    procs: list[Proc] = field(default_factory=list)


def body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}).encode()


def run_overhead(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    planes = data_planes(args.data_plane, first="relay")  # the baseline first
    cpus = available_cpus()
    gateway_cpu = args.gateway_cpu if args.gateway_cpu is not None else cpus[-1]
    if gateway_cpu not in cpus:
        print(
            f"flotilla gateway bench overhead: --gateway-cpu {gateway_cpu} is not one of {cpus}",
            file=sys.stderr,
        )
        return 2
    others = [c for c in cpus if c != gateway_cpu] or cpus
    try:
        model = ensure_model(args.model, out)
    except StartupError as exc:
        print(f"flotilla gateway bench overhead: {exc}", file=sys.stderr)
        return 2
    engine_port, stub_port, relay_port, picker_http_port, picker_port, envoy_port, admin_port = free_ports(7)
    engine = Proc("engine", engine_argv(model, ENGINE_MODEL, engine_port, None, args.threads), engine_port,
                  out / "overhead-engine.log")  # fmt: skip
    stub = Proc("stub", [sys.executable, "-m", "flotilla.bench.gateway.stub", FLAG_PORT, str(stub_port)], stub_port,
                out / "overhead-stub.log", cpus=others)  # fmt: skip
    models = {ENGINE_MODEL: [engine.url], STUB_MODEL: [stub.url]}
    gateways: list[Proc] = []
    fronts: dict[str, Front] = {}
    if "relay" in planes:
        relay = Proc("relay", gateway_argv(models, args.routing, relay_port), relay_port,
                     out / "overhead-relay.log", cpus=[gateway_cpu])  # fmt: skip
        gateways.append(relay)
        fronts["relay"] = Front("relay", relay_port, relay.url + METRICS_PATH, [relay])
    if "envoy" in planes:
        picker = Proc("picker", gateway_argv(models, args.routing, picker_http_port, picker_port),
                      picker_http_port, out / "overhead-picker.log", cpus=[gateway_cpu])  # fmt: skip
        gateways.append(picker)
        fronts["envoy"] = Front("envoy", envoy_port, picker.url + METRICS_PATH, [picker])
    started: list[Proc] = []
    try:
        progress(f"starting an engine, the stub (CPUs {others}) and {' and '.join(_named(p) for p in planes)} "
                 f"(CPU {gateway_cpu}); logs in {out}")  # fmt: skip
        started += [engine.start(), stub.start()]
        wait_healthy([engine, stub], args.startup_timeout)
        started += [g.start() for g in gateways]
        wait_healthy(gateways, args.startup_timeout)
        if "envoy" in planes:
            envoy = envoy_proc("envoy", picker_port, envoy_port, admin_port, out / "overhead-envoy.log",
                               concurrency=ENVOY_CONCURRENCY, cpus=[gateway_cpu])  # fmt: skip
            started.append(envoy.start())
            wait_healthy([envoy], args.startup_timeout)
            fronts["envoy"].procs.insert(0, envoy)
        bounds = start_bounds(stub_port, out, gateway_cpu, started, args) if args.bounds else {}
        latency = asyncio.run(measure_latency(engine_port, fronts, ENGINE_MODEL, "engine", args))
        progress("stopping the engine (the rest needs only the stub)")
        engine.stop()
        instant = asyncio.run(measure_latency(stub_port, fronts | bounds, STUB_MODEL, "stub", args))
        throughput = measure_throughput(stub_port, fronts | bounds, others, args)
    except (StartupError, HTTPError, OSError) as exc:
        print(
            f"flotilla gateway bench overhead: {type(exc).__name__}: {exc} (logs in {out})", file=sys.stderr
        )
        return 1
    finally:
        progress("stopping the data planes, the stub and the engine")
        stop_all(started)
    report = {
        "benchmark": "gateway-overhead",
        "settings": {
            "model": str(model),
            "data_planes": list(planes),
            "bounds": list(BOUND_PLANES) if args.bounds else [],
            "requests": args.requests,
            "block": args.block,
            "routing": args.routing,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "gateway_cpu": gateway_cpu,
            "envoy_concurrency": ENVOY_CONCURRENCY,
            "client_and_stub_cpus": others,
            "threads_per_engine": args.threads,
            "targets": targets(args),
        },  # fmt: skip
        "latency": latency,
        "latency_instant_upstream": instant,
        "throughput": throughput,
    }
    path = out / "overhead.json"
    path.write_text(json.dumps(json_safe(report), indent=1))
    print(format_overhead(report))
    progress(f"wrote {path}")
    measured = [*planes, *(BOUND_PLANES if args.bounds else ())]
    failed = latency["errors"] + instant["errors"] + sum(throughput[p]["errors"] for p in measured)
    return 0 if failed == 0 else 1


def start_bounds(
    stub_port: int, out: Path, cpu: int, started: list[Proc], args: argparse.Namespace
) -> dict[str, Front]:
    """`--bounds`: the null picker and one Envoy per bound plane, all pinned to the data planes' CPU and
    in front of the stub (bounds.py); each started process is appended to `started`."""
    binary = build_null_picker(out)
    null_port, *ports = free_ports(1 + 2 * len(BOUND_PLANES))
    null = null_picker_proc(binary, null_port, stub_port, out / "overhead-null-picker.log", [cpu])
    started.append(null.start())
    wait_healthy([null], args.startup_timeout)
    fronts: dict[str, Front] = {}
    for plane, port, admin_port in zip(BOUND_PLANES, ports[0::2], ports[1::2], strict=True):

        def edit(config: dict[str, Any], plane: str = plane) -> dict[str, Any]:
            return bound_config(config, plane, stub_port)

        envoy = envoy_proc(f"envoy-{plane}", null_port, port, admin_port, out / f"overhead-{plane}.log",
                           concurrency=ENVOY_CONCURRENCY, cpus=[cpu], edit=edit)  # fmt: skip
        progress(f"starting {_named(plane)} (CPU {cpu})")
        started.append(envoy.start())
        wait_healthy([envoy], args.startup_timeout)
        fronts[plane] = Front(plane, port, None, [envoy] if plane == ENVOY_ALONE else [envoy, null])
    return fronts


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _named(plane: str) -> str:
    if plane == "envoy":
        return "Envoy (--concurrency 1) with the picker"
    return DATA_PLANE_NAMES.get(plane, plane)


def targets(args: argparse.Namespace) -> dict[str, Any]:
    """The targets: added latency per data plane (percentile -> ms) and the throughput ratio."""
    return {
        "added_ms": {
            "relay": {"p50": args.target_ms},
            "envoy": {"p50": args.envoy_target_p50_ms, "p99": args.envoy_target_p99_ms},
        },
        "envoy_over_relay_requests_per_s": args.throughput_target,
    }


async def measure_latency(
    upstream_port: int, fronts: dict[str, Front], model: str, label: str, args: argparse.Namespace
) -> dict[str, Any]:
    """`--requests` sequential completions straight to the upstream and as many through each data plane,
    in blocks taking turns (the order rotates every round); each gateway's own added-latency histogram
    alongside."""
    conns = {"direct": Connection(HOST, upstream_port)}
    conns.update({plane: Connection(HOST, front.port) for plane, front in fronts.items()})
    payload = body(model)
    errors: list[str] = []

    async def timed(conn: Connection) -> float | None:
        start = time.perf_counter()
        status, data = await conn.request("POST", COMPLETIONS, payload)
        elapsed = time.perf_counter() - start
        if status != 200:
            errors.append(f"HTTP {status}: {data[:200].decode(errors='replace')}")
            return None
        return elapsed

    try:
        progress(f"added latency ({label}): warm-up, {WARMUP_REQUESTS} requests each way")
        for _ in range(WARMUP_REQUESTS):
            for conn in conns.values():
                await timed(conn)
        errors.clear()
        metered = {plane: front.metrics_url for plane, front in fronts.items() if front.metrics_url}
        before = {plane: get_text(url) for plane, url in metered.items()}
        samples: dict[str, list[float]] = {name: [] for name in conns}
        progress(f"added latency ({label}): {args.requests} requests each way ({', '.join(conns)}), "
                 f"blocks of {args.block} taking turns")  # fmt: skip
        rounds = 0
        order = list(conns.items())
        while any(len(v) < args.requests for v in samples.values()):
            shift = rounds % len(order)
            for name, conn in order[shift:] + order[:shift]:
                for _ in range(min(args.block, args.requests - len(samples[name]))):
                    elapsed = await timed(conn)
                    if elapsed is not None:
                        samples[name].append(elapsed)
                    elif len(errors) > args.requests:
                        raise HTTPError(f"too many failed requests; the first: {errors[0]}")
            rounds += 1
            if rounds % 5 == 0:
                done = sum(len(v) for v in samples.values())
                p50s = ", ".join(f"{name} {distribution(v)['p50']:.2f} ms" for name, v in samples.items())
                progress(f"added latency ({label}): {done}/{len(samples) * args.requests} done; p50 {p50s}")
        after = {plane: get_text(url) for plane, url in metered.items()}
    finally:
        for conn in conns.values():
            await conn.close()
    summary = latency_summary(samples, targets(args)["added_ms"])
    for plane, figures in summary["data_planes"].items():
        added = figures["added_ms"]
        progress(f"added latency ({label}): {_named(plane)}: p50 {added['p50']:.2f} ms, "
                 f"p99 {added['p99']:.2f} ms")  # fmt: skip
        if plane not in metered:
            continue

        def delta(suffix: str, plane: str = plane) -> float:
            name = GATEWAY_ADDED_LATENCY + suffix
            return sample_sum(after[plane], name) - sample_sum(before[plane], name)

        mean = ratio(delta("_sum"), delta("_count"))  # the measured requests only (read after the warm-up)
        figures["reported_added_mean_ms"] = mean * 1000 if mean is not None else None
    summary["errors"] = len(errors)
    summary["error_samples"] = errors[:5]
    summary["samples_ms"] = {k: [round(v * 1000, 4) for v in vs] for k, vs in samples.items()}
    return summary


def measure_throughput(
    stub_port: int, fronts: dict[str, Front], cpus: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """The closed loop through each data plane, then straight to the stub, with this process on `cpus`
    (not the data planes') while it runs."""
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    results: dict[str, Any] = {}
    try:
        for plane, front in fronts.items():
            progress(
                f"throughput: {args.concurrency} clients through {_named(plane)} for {args.duration:g} s"
            )
            before, start = {p.name: cpu_seconds(p.pid) for p in front.procs}, time.perf_counter()
            results[plane] = asyncio.run(closed_loop(front.port, args.concurrency, args.duration))
            wall = time.perf_counter() - start
            results[plane]["cpu_share"] = cpu_shares(
                before, {p.name: cpu_seconds(p.pid) for p in front.procs}, wall
            )
            shares = ", ".join(f"{name} {_pct(v)}" for name, v in results[plane]["cpu_share"].items())
            progress(f"throughput: {results[plane]['requests_per_s']:.0f} requests/s through {_named(plane)} "
                     f"(of its core: {shares})")  # fmt: skip
        progress(f"throughput: the same loop straight to the stub for {STUB_DIRECT_SECONDS:g} s "
                 "(the client's own ceiling)")  # fmt: skip
        direct = asyncio.run(closed_loop(stub_port, args.concurrency, STUB_DIRECT_SECONDS))
    finally:
        os.sched_setaffinity(0, mine)
    planes = {plane: results[plane] for plane in fronts}
    return {**results, "stub_direct": direct,
            "comparison": ceiling_comparison(planes, direct, args.throughput_target)}  # fmt: skip


async def closed_loop(port: int, concurrency: int, duration: float) -> dict[str, Any]:
    payload = body(STUB_MODEL)
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    window = (start + WARMUP_SECONDS, start + WARMUP_SECONDS + duration)

    async def client() -> None:
        nonlocal errors
        conn = Connection(HOST, port)
        try:
            while time.perf_counter() < window[1]:
                sent = time.perf_counter()
                try:
                    status, _ = await conn.request("POST", COMPLETIONS, payload)
                except HTTPError:
                    status = 0
                done = time.perf_counter()
                if window[0] <= sent and done <= window[1]:
                    if status == 200:
                        latencies.append(done - sent)
                    else:
                        errors += 1
        finally:
            await conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return throughput_summary(latencies, errors, duration, concurrency)
