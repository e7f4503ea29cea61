"""`flotilla engine bench fair`: two tenants on one engine, one sending `--ratio` times the other's rate,
together past the engine's capacity. Runs the same arrivals under each policy (default fcfs, then fair)
and reports the quiet tenant's TTFT, each tenant's share of the tokens, Jain's fairness index and the
total throughput, then the issue's targets: the quiet tenant's TTFT p95 at least 5x lower under `fair`
than under `fcfs`, and total throughput within 5% of fcfs. Prints PASS/MISS; asserts nothing.

How a run goes:

- Calibration: a closed loop (the batch kept full) for `--calibration-seconds` measures the engine's
  capacity in output tokens/s on this machine. The offered load is then `--overload` x that capacity,
  split `--ratio`:1 between the loud and the quiet tenant (unless `--quiet-rate` sets the rates).
- Arrivals: Poisson per tenant for `--duration` seconds, drawn once from `--seed`, so every policy gets
  the same requests at the same offsets. Each policy gets a fresh engine and one thread that adds every
  request whose time has come (arrival_time = its scheduled wall-clock time, so a late add counts
  against the engine), then steps. After the arrivals it keeps stepping until the queue drains, or
  until `--drain-limit` x `--duration` seconds, when the rest are aborted and reported as unfinished.

The figures (`summarize`, a pure function):

- TTFT = first token time - arrival time. A request that never got a first token counts as
  TTFT = end of run - arrival (a lower bound; the report gives how many).
- Throughput = output tokens / wall time of the run (the drain included; aborted requests' tokens
  count). `window_throughput_tok_s` counts only the overload window (while arrivals go on).
- Token share: each tenant's fraction of the tokens generated during the overload window (over the
  whole run, every drained request has all its tokens, so the shares would only echo the demand).
- Jain's index J = (sum x)^2 / (n sum x^2), over x_t = tokens served to tenant t in the window /
  t's max-min fair share of the tokens served in the window. The fair share comes from water-filling
  those tokens over the tenants' demands (the output tokens they asked for): a tenant asking for less
  than an equal split gets all it asked for, and the rest is split among the others. Under overload a
  raw Jain over served rates would call the 10:1 demand itself unfair, and one over served / demanded
  would call fcfs (which serves in proportion to demand) perfectly fair; normalizing by the max-min
  share gives J = 1 exactly when the quiet tenant gets all it asked for and the loud one the remainder.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flotilla.bench.engine.fair_figures import (
    LOUD,
    QUIET,
    RequestRecord,
    compare,
    format_report,
    percentile,
    plot,
    summarize,
)
from flotilla.bench.engine.offline import parse_range
from flotilla.bench.engine.setup import engine_header, json_safe
from flotilla.contract import SCHEDULING_POLICIES
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.engine_args import parse_bytes, thread_count

PROGRESS_EVERY_S = 5.0


def add_bench_fair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (e.g. from `flotilla model init`)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default 30)")
    parser.add_argument(
        "--quiet-rate",
        type=float,
        default=None,
        help="quiet tenant's requests/s (default: from --overload and the calibration)",
    )
    parser.add_argument("--ratio", type=float, default=10.0, help="loud rate / quiet rate (default 10)")
    parser.add_argument(
        "--overload",
        type=float,
        default=1.5,
        help="offered output tokens/s over the calibrated capacity (default 1.5)",
    )
    parser.add_argument("--input-len", default="32:128", help="prompt tokens, N or uniform in A:B")
    parser.add_argument("--output-len", default="32:128", help="output tokens, N or uniform in A:B")
    parser.add_argument(
        "--policies", default="fcfs,fair", help="comma-separated, run in order (default fcfs,fair)"
    )
    parser.add_argument(
        "--calibration-seconds",
        type=float,
        default=5.0,
        help="closed-loop capacity run (default 5; 0 skips it, which needs --quiet-rate)",
    )
    parser.add_argument(
        "--drain-limit",
        type=float,
        default=2.0,
        help="stop each run at this multiple of --duration, aborting what is left (default 2)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine batch size (default 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None, help="KV cache size (e.g. 256MiB)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--threads", type=thread_count, default=0, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures (and each request) to this file")
    parser.add_argument("--png", help="write a PNG of TTFT over arrival time, per tenant and policy")


# -- the workload --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    request_id: str
    tenant: str
    at: float  # seconds after the run starts
    prompt: list[int]
    output_len: int


def make_schedule(
    duration: float,
    rates: dict[str, float],
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[Arrival]:
    """Poisson arrivals per tenant over [0, duration), in time order. Each tenant draws from its own
    generator, so one tenant's requests do not change when the other's rate does."""
    arrivals = []
    for tenant, rate in rates.items():
        rng = random.Random(f"{seed}-{tenant}")
        t, i = rng.expovariate(rate), 0
        while t < duration:
            # Avoid the low ids, where the presets keep their special tokens.
            prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(*input_len))]
            arrivals.append(Arrival(f"{tenant}-{i}", tenant, t, prompt, rng.randint(*output_len)))
            t, i = t + rng.expovariate(rate), i + 1
    return sorted(arrivals, key=lambda a: a.at)


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def calibrate(
    engine, seconds: float, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> dict[str, Any]:
    """Closed loop: twice the batch size in flight, topped up as requests finish, for `seconds`. Counts
    from the end of the first step (the first batch's prefill is warm-up)."""
    rng = random.Random(f"{seed}-calibration")
    vocab = engine.model_config.vocab_size
    in_flight = 2 * engine.config.max_num_seqs

    def add() -> None:
        prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(*input_len))]
        engine.add_request(prompt, _params(rng.randint(*output_len)), tenant="calibration")

    for _ in range(in_flight):
        add()
    engine.step()
    start = time.perf_counter()
    tokens, steps = 0, 0
    while time.perf_counter() - start < seconds:
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                add()
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "steps": steps,
        "output_tokens": tokens,
        "capacity_tok_s": tokens / elapsed,
        "in_flight": in_flight,
    }


def run_policy(
    engine,
    schedule: Sequence[Arrival],
    duration: float,
    limit: float,
    log: Callable[[str], None],
    label: str,
) -> tuple[list[RequestRecord], float]:
    """One open-loop run; returns each request's record and when the run ended (s after it started)."""
    records = {a.request_id: RequestRecord(a.request_id, a.tenant, a.at, a.output_len) for a in schedule}
    t0 = time.time()
    added, tokens, next_log = 0, 0, PROGRESS_EVERY_S
    while True:
        now = time.time() - t0
        while added < len(schedule) and schedule[added].at <= now:
            a = schedule[added]
            engine.add_request(
                a.prompt,
                _params(a.output_len),
                request_id=a.request_id,
                arrival_time=t0 + a.at,
                tenant=a.tenant,
            )
            added += 1
        if now >= limit:
            break
        if engine.has_unfinished_requests():
            outputs = engine.step()
            done = time.time() - t0
            for out in outputs:
                record = records[out.request_id]
                n = len(out.new_token_ids)
                record.output_tokens += n
                tokens += n
                if done <= duration:
                    record.window_tokens += n
                if record.ttft is None and out.first_token_time is not None:
                    record.ttft = out.first_token_time - out.arrival_time
                record.finished = record.finished or out.finished
        elif added < len(schedule):
            time.sleep(min(0.05, max(0.0, schedule[added].at - (time.time() - t0))))
        else:
            break  # drained
        if now >= next_log:
            next_log += PROGRESS_EVERY_S
            stats = engine.stats()
            quiet = [r.ttft for r in records.values() if r.tenant == QUIET and r.ttft is not None]
            quiet_p95 = f"{percentile(quiet, 0.95) * 1e3:.0f} ms" if quiet else "-"
            log(
                f"bench fair [{label}] {now:5.1f} s: {added}/{len(schedule)} arrived, "
                f"{sum(r.finished for r in records.values())} finished, {stats.num_waiting} waiting, "
                f"{stats.num_running} running, {tokens / max(now, 1e-9):.0f} tok/s, "
                f"quiet TTFT p95 so far {quiet_p95}"
            )
    end = time.time() - t0
    for record in records.values():
        if not record.finished:
            engine.abort(record.request_id)
    return list(records.values()), end


# -- the command ------------------------------------------------------------------------------------------
def run_bench_fair(args: argparse.Namespace) -> int:
    import torch

    from flotilla.engine.llm_engine import LLMEngine

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        problems = [
            (args.duration > 0, "--duration must be positive"),
            (args.ratio > 0, "--ratio must be positive"),
            (args.overload > 0, "--overload must be positive"),
            (args.quiet_rate is None or args.quiet_rate > 0, "--quiet-rate must be positive"),
            (args.drain_limit >= 1, "--drain-limit must be at least 1"),
            (args.calibration_seconds > 0 or args.quiet_rate is not None, "--calibration-seconds 0 needs --quiet-rate"),
            (bool(policies), "--policies names no policy"),
        ]  # fmt: skip
        for ok, problem in problems:
            if not ok:
                raise ValueError(problem)

        def make_engine(policy: str) -> LLMEngine:
            return LLMEngine(
                EngineConfig(
                    model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory=args.kv_cache_memory, show_progress=False, cpu_threads=args.threads,
                    seed=args.seed, scheduling_policy=policy,
                )
            )  # fmt: skip

        unknown = [p for p in policies if p not in SCHEDULING_POLICIES]
        if unknown:
            raise ValueError(f"--policies: unknown policy {unknown[0]!r} ({', '.join(SCHEDULING_POLICIES)})")
        engine = make_engine("fcfs")
        if input_len[1] >= engine.max_model_len:
            raise ValueError(
                f"--input-len up to {input_len[1]} tokens: the model's context is {engine.max_model_len}"
            )
    except ValueError as exc:
        print(f"flotilla engine bench fair: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    report: dict[str, Any] = {
        **engine_header(args, engine, input_len, output_len),
        "duration_s": args.duration,
        "drain_limit_s": args.drain_limit * args.duration,
        "ratio": args.ratio,
        "seed": args.seed,
        "policies": policies,
    }
    _warm_up(engine)
    mean_out = (output_len[0] + output_len[1]) / 2
    capacity = None
    if args.calibration_seconds > 0:
        log(f"bench fair: calibrating capacity ({args.calibration_seconds:g} s closed loop) ...")
        report["calibration"] = calibrate(engine, args.calibration_seconds, input_len, output_len, args.seed)
        capacity = report["calibration"]["capacity_tok_s"]
        log(
            f"bench fair: capacity {capacity:.0f} output tok/s ({report['calibration']['in_flight']} in flight, "
            f"{report['calibration']['steps']} steps in {report['calibration']['seconds']:.1f} s)"
        )
    vocab = engine.model_config.vocab_size
    del engine
    if args.quiet_rate is not None:
        quiet_rate = args.quiet_rate
    else:
        assert capacity is not None
        quiet_rate = args.overload * capacity / mean_out / (args.ratio + 1)
    rates = {LOUD: args.ratio * quiet_rate, QUIET: quiet_rate}
    offered = (rates[LOUD] + rates[QUIET]) * mean_out
    report["rates"] = {
        "loud_req_s": rates[LOUD],
        "quiet_req_s": quiet_rate,
        "offered_tok_s": offered,
        "overload": offered / capacity if capacity else None,
    }
    schedule = make_schedule(args.duration, rates, input_len, output_len, vocab, args.seed)
    counts = {t: sum(a.tenant == t for a in schedule) for t in rates}
    report["rates"].update(loud_requests=counts[LOUD], quiet_requests=counts[QUIET])
    load = f" = {offered / capacity:.2f}x capacity" if capacity else ""
    log(
        f"bench fair: loud {rates[LOUD]:.2f} req/s, quiet {quiet_rate:.2f} req/s, {offered:.0f} output tok/s "
        f"offered{load}; {counts[LOUD]} + {counts[QUIET]} requests over {args.duration:g} s"
    )

    report["runs"] = {}
    all_records: dict[str, tuple[list[RequestRecord], float]] = {}
    for policy in policies:
        engine = make_engine(policy)
        _warm_up(engine)
        log(f"bench fair [{policy}]: running ...")
        records, end = run_policy(
            engine, schedule, args.duration, args.drain_limit * args.duration, log, policy
        )
        del engine
        summary = summarize(records, args.duration, end)
        report["runs"][policy] = {**summary, "requests": [asdict(r) for r in records]}
        all_records[policy] = (records, end)
        log(
            f"bench fair [{policy}]: done in {end:.1f} s, {summary['finished']}/{summary['offered']} finished, "
            f"{summary['throughput_tok_s']:.0f} tok/s"
        )
    runs = report["runs"]
    if "fcfs" in runs and "fair" in runs and all(QUIET in runs[p]["tenants"] for p in ("fcfs", "fair")):
        report["comparison"] = compare(report["runs"]["fcfs"], report["runs"]["fair"])

    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe(report), indent=1) + "\n")
        log(f"bench fair: wrote {args.json}")
    if args.png:
        plot(all_records, args.duration, args.png)
        log(f"bench fair: wrote {args.png}")
    return 0


def _warm_up(engine) -> None:
    engine.generate([[9, 10, 11, 12]], _params(4), use_tqdm=False)
