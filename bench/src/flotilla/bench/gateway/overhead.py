"""`flotilla gateway bench overhead`: what the gateway costs a request, and how many it can pass on a core.

1. Added latency. One engine (one torch thread) and a gateway with `--static-model` to it. The same small
   non-streaming completion (a short prompt, max_tokens 1) is sent sequentially `--requests` times
   straight to the engine and as many times through the gateway, in alternating blocks of `--block` (the
   order flipping each round), so that drift in the machine's load hits both alike. The added latency is
   the gateway's percentile minus the direct one, per percentile; the target is p50 <= 2 ms. The gateway's
   own figure (its added-latency histogram: arrival to upstream send, mean) is reported beside it.
2. Throughput ceiling. The gateway, pinned to one CPU (os.sched_setaffinity in the child), in front of a
   stub upstream that answers at once (stub.py; the engine would be the bottleneck); `--concurrency`
   closed-loop clients on their own keep-alive connections for `--duration` seconds: requests/s. The
   client and the stub run on the other CPUs; the same loop straight to the stub shows the ceiling of the
   client and stub themselves, which must be well above the gateway's for the figure to be the gateway's.

Both use a minimal HTTP client (rawhttp.py) so the client's own cost stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flotilla.bench.gateway.figures import (
    distribution,
    json_safe,
    overhead_summary,
    ratio,
    sample_sum,
    throughput_summary,
)
from flotilla.bench.gateway.procs import (
    HOST,
    Proc,
    StartupError,
    available_cpus,
    engine_argv,
    ensure_model,
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


def body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}).encode()


def run_overhead(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    engine_port, stub_port, gateway_port = free_ports(3)
    engine = Proc("engine", engine_argv(model, ENGINE_MODEL, engine_port, None, args.threads), engine_port,
                  out / "overhead-engine.log")  # fmt: skip
    stub = Proc("stub", [sys.executable, "-m", "flotilla.bench.gateway.stub", FLAG_PORT, str(stub_port)], stub_port,
                out / "overhead-stub.log", cpus=others)  # fmt: skip
    models = {ENGINE_MODEL: [engine.url], STUB_MODEL: [stub.url]}
    gateway = Proc("gateway", gateway_argv(models, args.routing, gateway_port), gateway_port,
                   out / "overhead-gateway.log", cpus=[gateway_cpu])  # fmt: skip
    started: list[Proc] = []
    try:
        progress(
            f"starting an engine, the stub (CPUs {others}) and the gateway (CPU {gateway_cpu}); logs in {out}"
        )
        started += [engine.start(), stub.start()]
        wait_healthy([engine, stub], args.startup_timeout)
        started.append(gateway.start())
        wait_healthy([gateway], args.startup_timeout)
        latency = asyncio.run(
            measure_latency(engine_port, gateway.url, gateway_port, ENGINE_MODEL, "engine", args)
        )
        progress("stopping the engine (the rest needs only the stub)")
        engine.stop()
        instant = asyncio.run(measure_latency(stub_port, gateway.url, gateway_port, STUB_MODEL, "stub", args))
        throughput = measure_throughput(stub_port, gateway_port, others, args)
    except (StartupError, HTTPError, OSError) as exc:
        print(
            f"flotilla gateway bench overhead: {type(exc).__name__}: {exc} (logs in {out})", file=sys.stderr
        )
        return 1
    finally:
        progress("stopping the gateway, the stub and the engine")
        stop_all(started)
    report = {
        "benchmark": "gateway-overhead",
        "settings": {
            "model": str(model),
            "requests": args.requests,
            "block": args.block,
            "routing": args.routing,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "gateway_cpu": gateway_cpu,
            "client_and_stub_cpus": others,
            "threads_per_engine": args.threads,
        },  # fmt: skip
        "latency": latency,
        "latency_instant_upstream": instant,
        "throughput": throughput,
    }
    path = out / "overhead.json"
    path.write_text(json.dumps(json_safe(report), indent=1))
    print(format_overhead(report))
    progress(f"wrote {path}")
    failed = latency["errors"] + instant["errors"] + throughput["gateway"]["errors"]
    return 0 if failed == 0 else 1


async def measure_latency(
    upstream_port: int, gateway_url: str, gateway_port: int, model: str, label: str, args: argparse.Namespace
) -> dict[str, Any]:
    """`--requests` sequential completions each way, straight to the upstream and through the gateway, in
    alternating blocks (the order flips every round); the gateway's own added-latency histogram alongside."""
    direct, via = Connection(HOST, upstream_port), Connection(HOST, gateway_port)
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
            await timed(direct)
            await timed(via)
        errors.clear()
        before = get_text(gateway_url + METRICS_PATH)
        samples: dict[str, list[float]] = {"direct": [], "gateway": []}
        progress(
            f"added latency ({label}): {args.requests} requests each way, alternating blocks of {args.block}"
        )
        rounds = 0
        while any(len(v) < args.requests for v in samples.values()):
            order = [("direct", direct), ("gateway", via)]
            for name, conn in order if rounds % 2 == 0 else order[::-1]:
                for _ in range(min(args.block, args.requests - len(samples[name]))):
                    elapsed = await timed(conn)
                    if elapsed is not None:
                        samples[name].append(elapsed)
                    elif len(errors) > args.requests:
                        raise HTTPError(f"too many failed requests; the first: {errors[0]}")
            rounds += 1
            done = len(samples["direct"]) + len(samples["gateway"])
            if rounds % 5 == 0:
                d, g = distribution(samples["direct"]), distribution(samples["gateway"])
                progress(f"added latency ({label}): {done}/{2 * args.requests} done; p50 direct "
                         f"{d['p50']:.2f} ms, through the gateway {g['p50']:.2f} ms")  # fmt: skip
        after = get_text(gateway_url + METRICS_PATH)
    finally:
        await direct.close()
        await via.close()
    summary = overhead_summary(samples["direct"], samples["gateway"], args.target_ms)

    def delta(suffix: str) -> float:
        name = GATEWAY_ADDED_LATENCY + suffix
        return sample_sum(after, name) - sample_sum(before, name)

    mean = ratio(delta("_sum"), delta("_count"))  # the measured requests only (read after the warm-up)
    summary["gateway_reported_added_mean_ms"] = mean * 1000 if mean is not None else None
    summary["errors"] = len(errors)
    summary["error_samples"] = errors[:5]
    summary["samples_ms"] = {k: [round(v * 1000, 4) for v in vs] for k, vs in samples.items()}
    progress(f"added latency ({label}): p50 {summary['added_ms']['p50']:.2f} ms, "
             f"p95 {summary['added_ms']['p95']:.2f} ms")  # fmt: skip
    return summary


def measure_throughput(stub_port: int, gateway_port: int, cpus: list[int], args: argparse.Namespace) -> dict:
    """The closed loop, with this process on `cpus` (not the gateway's) while it runs."""
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        progress(f"throughput: {args.concurrency} clients through the gateway for {args.duration:g} s")
        gateway = asyncio.run(closed_loop(gateway_port, args.concurrency, args.duration))
        progress(f"throughput: {gateway['requests_per_s']:.0f} requests/s through the gateway; now the same "
                 f"loop straight to the stub for {STUB_DIRECT_SECONDS:g} s (the client's own ceiling)")  # fmt: skip
        direct = asyncio.run(closed_loop(stub_port, args.concurrency, STUB_DIRECT_SECONDS))
    finally:
        os.sched_setaffinity(0, mine)
    return {"gateway": gateway, "stub_direct": direct}


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


def format_overhead(report: dict[str, Any]) -> str:
    lat, instant, thr = report["latency"], report["latency_instant_upstream"], report["throughput"]
    keys = ("p50", "p90", "p95", "p99", "mean")
    lines = [f"{'sequential requests (ms)':<34}" + "".join(f"{k:>10}" for k in keys)]
    for upstream, figures in (("the engine", lat), ("the stub", instant)):
        rows = (
            (f"straight to {upstream}", figures["direct_ms"]),
            ("  through the gateway", figures["gateway_ms"]),
            ("  added by the gateway", figures["added_ms"]),
        )
        for label, row in rows:
            lines.append(f"{label:<34}" + "".join(f"{row[k]:>10.3f}" for k in keys))
        reported = figures["gateway_reported_added_mean_ms"]
        if reported is not None:
            lines.append(f"{'  gateway-reported, arrival->send':<34}{'':>40}{reported:>10.3f}")
    verdict = "MET" if lat["met"] else "MISSED"
    lines.append(
        f"added p50 in front of the engine {lat['added_ms']['p50']:.3f} ms (target <= "
        f"{lat['target_added_p50_ms']:g} ms: {verdict}); in front of the stub {instant['added_ms']['p50']:.3f} ms; "
        f"{lat['errors'] + instant['errors']} failed"
    )
    gw, st = thr["gateway"], thr["stub_direct"]
    lines.append(
        f"throughput through the gateway pinned to CPU {report['settings']['gateway_cpu']}: "
        f"{gw['requests_per_s']:.0f} requests/s at concurrency {gw['concurrency']} (latency p50 "
        f"{gw['latency_ms']['p50']:.2f} ms, p99 {gw['latency_ms']['p99']:.2f} ms, {gw['errors']} errors); "
        f"the same client straight to the stub: {st['requests_per_s']:.0f} requests/s"
    )
    return "\n".join(lines)
