"""`flotilla gateway bench routing`: the same multi-turn chat workload through the gateway to N replicas of
one engine, once per routing policy (default round-robin, then prefix), each on freshly started engines so
that every policy begins with empty prefix caches; through Envoy in front of the endpoint picker (the
default `--data-plane envoy`), through the Python relay (`relay`), or through each in turn (`both`).

A run, per data plane and policy:

1. Start N engines (`flotilla engine serve`, one torch thread each, a KV cache that holds the whole
   workload) and a gateway with `--static-model NAME=URL,...` and the policy; wait for /health. For Envoy,
   the gateway also serves the picker (`--picker-port`), and Envoy runs on the bootstrap `flotilla gateway
   envoy-config` prints for it (one worker thread); the clients send to Envoy's listener, the counters are
   read from the gateway's /metrics (the picker's).
2. Warm up: one short request straight to each engine (first-request costs), then, through the gateway,
   one request per system prompt. That is the steady state of a chat service, whose system prompts have
   been seen before: under prefix routing each prompt is then cached on the replica the gateway bound it
   to; under round robin on one replica of N, and the others still miss it.
3. Measure: `--concurrency` users at a time, each running its `--turns` turns back to back (a closed loop:
   the offered load is the same for every policy), every turn streamed: TTFT is the time to the first
   chunk with content. The engines' prefix-cache counters and the gateway's are read before and after.

The report: TTFT p50/p95 (all turns, first turns, later turns), latency, output tok/s, the engines' prefix
cache hit rate (delta hits / delta queries, summed over the replicas), the gateway's predicted hit share
(its predicted hit tokens / prompt tokens; round robin predicts nothing) and the ratio of round robin's TTFT
p95 to prefix's against the target (>= 2x), per data plane. JSON, a PNG (TTFT CDF and percentiles per
policy and data plane), a table per data plane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flotilla.bench.gateway.figures import (
    DATA_PLANE_NAMES,
    ChatRecord,
    compare_policies,
    data_planes,
    deltas,
    format_routing,
    json_safe,
    routing_summary,
    sample_by_label,
    sample_sum,
)
from flotilla.bench.gateway.procs import (
    Proc,
    StartupError,
    engine_argv,
    ensure_model,
    envoy_proc,
    free_ports,
    gateway_argv,
    model_context,
    progress,
    stop_all,
    wait_healthy,
)
from flotilla.bench.gateway.workload import Workload, chat_messages, make_workload, words
from flotilla.contract import (
    GATEWAY_PREDICTED_HIT_TOKENS,
    GATEWAY_PROMPT_TOKENS,
    GATEWAY_ROUTING_DECISIONS,
    LABEL_REASON,
    METRICS_PATH,
    OPENAI_PATH,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    REQUEST_SUCCESS,
    counter_total,
)

SERVED_NAME = "tiny"
ENVOY_CONCURRENCY = 1  # Envoy's worker threads
PROGRESS_EVERY_S = 5.0
REPLY_TOKENS_PER_OUTPUT_TOKEN = 2  # a reply re-tokenized as history: room for a worse split than generated


def run_routing(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        model = ensure_model(args.model, out)
        workload, sizing = plan_workload(args, model)
    except (StartupError, ValueError) as exc:
        print(f"flotilla gateway bench routing: {exc}", file=sys.stderr)
        return 2
    progress(
        f"workload: {len(workload.system_prompts)} system prompts of ~{sizing['system_tokens']} tokens, "
        f"{len(workload.conversations)} users x {workload.turns} turns ({workload.requests} requests), "
        f"messages ~{sizing['user_tokens']} tokens, longest prompt ~{sizing['longest_prompt_tokens']} of "
        f"{sizing['context']} tokens; concurrency {args.concurrency}, {args.replicas} replicas"
    )
    planes = data_planes(args.data_plane, first="envoy")  # the target's data plane first
    results: dict[str, dict[str, Any]] = {}
    requests: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for plane in planes:
        policies: dict[str, dict[str, Any]] = {}
        requests[plane] = {}
        for policy in args.policies:
            label = run_label(policy, plane, planes)
            try:
                summary, records = run_policy(policy, plane, label, workload, model, out, args)
            except (StartupError, FileNotFoundError) as exc:
                print(f"flotilla gateway bench routing: {exc}", file=sys.stderr)
                return 1
            except Exception as exc:  # an engine or the gateway misbehaved: say where to look
                print(f"flotilla gateway bench routing: {label}: {type(exc).__name__}: {exc} (logs in {out})",
                      file=sys.stderr)  # fmt: skip
                return 1
            policies[policy] = summary
            requests[plane][policy] = [asdict(r) for r in records]
            progress(
                f"{label}: TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, p95 {summary['ttft_ms']['p95']:.0f} ms, "
                f"{summary['output_tok_s']:.1f} output tok/s, engine prefix hit rate "
                f"{_pct(summary['engine_prefix_hit_rate'])}, {summary['failed']} failed"
            )
        results[plane] = {"policies": policies, "comparison": compare_policies(policies, args.target)}
    report = {
        "benchmark": "gateway-routing",
        "settings": {
            "model": str(model),
            "data_planes": list(planes),
            "replicas": args.replicas,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "threads_per_engine": args.threads,
            "kv_cache_memory": args.kv_cache_memory,
            "prime": not args.no_prime,
            "seed": args.seed,
            "policies": list(args.policies),
            "envoy_concurrency": ENVOY_CONCURRENCY,
        },  # fmt: skip
        "workload": sizing,
        "data_planes": results,
        "requests": requests,
    }
    json_path = out / "routing.json"
    json_path.write_text(json.dumps(json_safe(report), indent=1))
    for plane, result in results.items():
        print(f"through {DATA_PLANE_NAMES.get(plane, plane)}:")
        print(format_routing(result["policies"], result["comparison"]))
    flat = {
        run_label(p, plane, planes): summary
        for plane in planes
        for p, summary in results[plane]["policies"].items()
    }
    runs = {run_label(p, plane, planes): rs for plane in planes for p, rs in requests[plane].items()}
    png = plot_routing(runs, flat, out / "routing.png")
    progress(f"wrote {json_path}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    failed = [s["failed"] for result in results.values() for s in result["policies"].values()]
    return 0 if not any(failed) else 1


def run_label(policy: str, plane: str, planes: tuple[str, ...]) -> str:
    """A run's name in the progress, the logs and the PNG: the policy, and the data plane when several."""
    return policy if len(planes) == 1 else f"{policy} ({plane})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def plan_workload(args: argparse.Namespace, model: Path) -> tuple[Workload, dict[str, Any]]:
    """The workload sized in the model's own tokens (its tokenizer, from the folder), checked to fit its
    context with the replies and the answer."""
    from flotilla.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer.from_folder(model)
    sample = words(random.Random(12345), 2000)
    per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 2000
    system_words = max(1, round((args.system_tokens - args.shared_preamble_tokens) / per_word))
    user_words = max(1, round(args.user_tokens / per_word))
    preamble_words = round(args.shared_preamble_tokens / per_word)
    workload = make_workload(args.systems, args.users, args.turns, system_words, user_words, args.seed,
                             preamble_words=preamble_words)  # fmt: skip
    context = model_context(model)
    longest = 0
    for conversation in workload.conversations:  # replies empty here, then counted as their token budget
        history = [(m, "") for m in conversation.messages[:-1]]
        messages = chat_messages(
            workload.system_prompts[conversation.system], history, conversation.messages[-1]
        )
        tokens = len(tokenizer.encode_chat(messages))
        longest = max(longest, tokens + (args.turns - 1) * args.max_tokens * REPLY_TOKENS_PER_OUTPUT_TOKEN)
    systems = [len(tokenizer.encode(p, add_special_tokens=False)) for p in workload.system_prompts]
    sizing = {
        "systems": args.systems, "users": args.users, "turns": args.turns, "requests": workload.requests,
        "tokens_per_word": round(per_word, 3), "system_tokens": round(sum(systems) / len(systems)),
        "user_tokens": args.user_tokens, "shared_preamble_tokens": args.shared_preamble_tokens,
        "longest_prompt_tokens": longest, "context": context,
    }  # fmt: skip
    if longest + args.max_tokens > context:
        raise ValueError(
            f"the longest prompt (~{longest} tokens, replies included) plus --max-tokens {args.max_tokens} "
            f"is over the model's context of {context} tokens: lower --system-tokens, --user-tokens or --turns"
        )
    return workload, sizing


def run_policy(
    policy: str, plane: str, label: str, workload: Workload, model: Path, out: Path, args: argparse.Namespace
) -> tuple[dict[str, Any], list[ChatRecord]]:
    ports = free_ports(args.replicas + 4)
    gateway_port, picker_port, envoy_port, admin_port = ports[-4:]
    logs = label.replace(" ", "-").replace("(", "").replace(")", "")
    engines = [
        Proc(
            f"{label} engine {i}",
            engine_argv(model, SERVED_NAME, port, args.kv_cache_memory, args.threads),
            port,
            out / f"{logs}-engine-{i}.log",
        )  # fmt: skip
        for i, port in enumerate(ports[: args.replicas])
    ]
    urls = [e.url for e in engines]
    envoy = plane == "envoy"
    argv = gateway_argv({SERVED_NAME: urls}, policy, gateway_port, picker_port if envoy else None)
    gateway = Proc(f"{label} gateway", argv, gateway_port, out / f"{logs}-gateway.log")
    started: list[Proc] = []
    try:
        progress(f"{label}: starting {len(engines)} engines (logs: {out}/{logs}-engine-*.log)")
        for engine in engines:
            started.append(engine.start())
        wait_healthy(engines, args.startup_timeout)
        progress(
            f"{label}: engines healthy (pids {', '.join(str(e.pid) for e in engines)}); starting the gateway"
            + (" (the picker) and Envoy" if envoy else "")
        )
        started.append(gateway.start())
        wait_healthy([gateway], args.startup_timeout)
        front = gateway.url
        if envoy:
            proxy = envoy_proc(f"{label} envoy", picker_port, envoy_port, admin_port, out / f"{logs}-envoy.log",
                               concurrency=ENVOY_CONCURRENCY)  # fmt: skip
            started.append(proxy.start())
            wait_healthy([proxy], args.startup_timeout)
            front = proxy.url
        return asyncio.run(measure(label, front, gateway.url, urls, workload, args))
    finally:
        progress(f"{label}: stopping {'Envoy, ' if envoy else ''}the gateway and the engines")
        stop_all(started)


async def measure(
    policy: str, front: str, gateway: str, engines: list[str], workload: Workload, args: argparse.Namespace
) -> tuple[dict[str, Any], list[ChatRecord]]:
    """The workload sent to `front` (Envoy's listener, or the relay's), the counters read from the engines
    and from `gateway` (the process that routes: the relay, or the picker)."""
    import httpx

    limits = httpx.Limits(
        max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8
    )
    # trust_env=False: never send benchmark traffic through a proxy from the environment.
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        progress(f"{policy}: warm-up: one request to each engine, one per system prompt through the gateway")
        for url in engines:
            rsp = await client.post(url + OPENAI_PATH + "/completions",
                                    json={"model": SERVED_NAME, "prompt": "warm up", "max_tokens": 2})  # fmt: skip
            rsp.raise_for_status()
        if not args.no_prime:
            for s, prompt in enumerate(workload.system_prompts):
                record = ChatRecord(conversation=-1, system=s, turn=0, start=0.0)
                messages = chat_messages(prompt, [], f"Warm-up for assistant {s}.")
                await chat_turn(client, front, messages, 1, record, time.perf_counter())
                if not record.ok:
                    raise StartupError(f"{policy}: the warm-up request failed: {record.error}")
        before = await scrape(client, gateway, engines)
        progress(f"{policy}: measuring {workload.requests} requests, {args.concurrency} users at a time")
        records: list[ChatRecord] = []
        queue: asyncio.Queue = asyncio.Queue()
        for conversation in workload.conversations:
            queue.put_nowait(conversation)
        t0 = time.perf_counter()

        async def user() -> None:
            while not queue.empty():
                conversation = queue.get_nowait()
                history: list[tuple[str, str]] = []
                system = workload.system_prompts[conversation.system]
                for turn, message in enumerate(conversation.messages):
                    record = ChatRecord(
                        conversation.index, conversation.system, turn, time.perf_counter() - t0
                    )
                    records.append(record)
                    reply = await chat_turn(
                        client, front, chat_messages(system, history, message), args.max_tokens, record, t0
                    )
                    if reply is None:
                        break  # the later turns need this reply
                    history.append((message, reply))

        async def report_progress() -> None:
            while True:
                await asyncio.sleep(PROGRESS_EVERY_S)
                done = [r for r in records if r.ok]
                ttfts = sorted(r.ttft for r in done if r.ttft is not None)
                median = f", TTFT p50 so far {ttfts[len(ttfts) // 2] * 1000:.0f} ms" if ttfts else ""
                progress(f"{policy}: {len(done)}/{workload.requests} done{median}")

        reporter = asyncio.ensure_future(report_progress())
        try:
            await asyncio.gather(*(user() for _ in range(args.concurrency)))
        finally:
            reporter.cancel()
        duration = time.perf_counter() - t0
        after = await scrape(client, gateway, engines)
    decisions = deltas(before["decisions"], after["decisions"])
    summary = routing_summary(
        records, duration,
        engine_hits=after["engine_hits"] - before["engine_hits"],
        engine_queries=after["engine_queries"] - before["engine_queries"],
        gateway_hit_tokens=after["gateway_hit_tokens"] - before["gateway_hit_tokens"],
        gateway_prompt_tokens=after["gateway_prompt_tokens"] - before["gateway_prompt_tokens"],
        decisions=decisions,
        replica_requests=[a - b for a, b in zip(after["replica_requests"], before["replica_requests"], strict=True)],
    )  # fmt: skip
    return summary, records


async def scrape(client, gateway: str, engines: list[str]) -> dict[str, Any]:
    """The counters the report takes deltas of: the engines' prefix cache (summed) and the gateway's."""
    texts = await asyncio.gather(*(client.get(url + METRICS_PATH) for url in engines))
    gateway_text = (await client.get(gateway + METRICS_PATH)).text
    return {
        "engine_hits": sum(sample_sum(t.text, counter_total(PREFIX_CACHE_HITS)) for t in texts),
        "engine_queries": sum(sample_sum(t.text, counter_total(PREFIX_CACHE_QUERIES)) for t in texts),
        "gateway_hit_tokens": sample_sum(gateway_text, counter_total(GATEWAY_PREDICTED_HIT_TOKENS)),
        "gateway_prompt_tokens": sample_sum(gateway_text, counter_total(GATEWAY_PROMPT_TOKENS)),
        "decisions": sample_by_label(gateway_text, counter_total(GATEWAY_ROUTING_DECISIONS), LABEL_REASON),
        "replica_requests": [sample_sum(t.text, counter_total(REQUEST_SUCCESS)) for t in texts],
    }


async def chat_turn(
    client, url: str, messages: list[dict[str, str]], max_tokens: int, record: ChatRecord, t0: float
) -> str | None:
    """One streamed chat turn; fills `record`; the reply's text, or None when it failed."""
    body = {
        "model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    reply: list[str] = []
    try:
        async with client.stream("POST", url + OPENAI_PATH + "/chat/completions", json=body) as rsp:
            if rsp.status_code != 200:
                detail = (await rsp.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {rsp.status_code}: {detail}"
                return None
            async for line in rsp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message", "an error event"))[:200]
                    return None
                usage = chunk.get("usage")
                if usage:
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.cached_tokens = int(
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if record.ttft is None:
                            record.ttft = time.perf_counter() - sent
                        reply.append(content)
        record.latency = time.perf_counter() - sent
    except Exception as exc:  # a failed request is a figure, not a crash
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return None
    if record.ttft is None:
        record.error = "no content came back"
        return None
    record.ok = True
    return "".join(reply)


def plot_routing(
    requests: dict[str, list[dict[str, Any]]], policies: dict[str, dict[str, Any]], path: Path
) -> Path | None:
    """TTFT CDF per run (a policy, on a data plane), and TTFT p50/p95 bars; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, records in requests.items():
        ttfts = sorted(r["ttft"] * 1000 for r in records if r["ok"] and r["ttft"] is not None)
        if ttfts:
            cdf.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=name)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    cdf.grid(True, alpha=0.3)
    cdf.legend()
    names = list(policies)
    width = 0.38
    for offset, (quantile, color) in enumerate((("p50", "#8da0cb"), ("p95", "#e78ac3"))):
        values = [policies[n]["ttft_ms"][quantile] or 0.0 for n in names]
        xs = [i + (offset - 0.5) * width for i in range(len(names))]
        drawn = bars.bar(xs, values, width, label=f"TTFT {quantile}", color=color)
        bars.bar_label(drawn, fmt="%.0f", fontsize=8)
    bars.set_xticks(range(len(names)), names)
    bars.set_ylabel("TTFT (ms)")
    bars.legend()
    bars.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        "flotilla gateway bench routing: shared-prefix multi-turn chat, TTFT per routing policy and data plane"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
