"""`flotilla engine bench serve`: a load generator for a running server.

It streams every request (token-id prompts, `ignore_eos`, exactly `--output-len` tokens), sends them
with Poisson arrivals at `--request-rate` (or all at once for `inf`) under `--max-concurrency`, and
reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99) plus throughput. TPOT is
(latency - TTFT) / (output tokens - 1). Import-light: httpx and matplotlib load inside the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from flotilla.engine.model.synthetic.presets import training_corpus


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests per second, Poisson (default inf)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prefix-len", type=int, default=0, help="leading prompt tokens all requests share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_file", help="write the figures (and each request) to this file")
    parser.add_argument("--plot", help="write a PNG of the latency percentiles over the run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class RequestResult:
    start: float  # seconds since the run began
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ok and self.ttft is not None and self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, like numpy's default
        pos = (len(ordered) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": statistics.fmean(ordered), "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    return {
        "completed": len(good),
        "failed": len(results) - len(good),
        "duration_s": duration,
        "request_throughput": len(good) / duration if duration > 0 else math.nan,
        "output_token_throughput": out_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else math.nan,
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "ttft_s": percentiles([r.ttft for r in good if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in good if r.tpot is not None]),
        "itl_s": percentiles([gap for r in good for gap in r.itl]),
        "e2el_s": percentiles([r.latency for r in good]),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }


async def _token_pool(client, url: str, headers: dict) -> list[int]:
    """Token ids this server's tokenizer produces for ordinary text: valid prompt material."""
    text = " ".join(training_corpus(seed=1)[:200])
    resp = await client.post(
        f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers
    )
    resp.raise_for_status()
    return sorted(set(resp.json()["tokens"]))


async def _one(client, url, headers, body, t0, result: RequestResult) -> None:
    sent = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - sent
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens came back"
    except Exception as exc:  # a failed request is a figure, not a crash
        result.error = f"{type(exc).__name__}: {exc}"


async def run_benchmark(
    url: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    prefix_len: int = 0,
    seed: int = 0,
    model: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
) -> tuple[dict, list[RequestResult]]:
    import httpx
    from tqdm import tqdm

    if not 0 <= prefix_len <= input_len or input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError(
            "need num_prompts >= 1, input_len >= 1, output_len >= 1 and 0 <= prefix_len <= input_len"
        )
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts, max_keepalive_connections=None)
    # trust_env=False: never route benchmark traffic through a proxy from the environment.
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        if model is None:
            resp = await client.get(f"{url}/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        pool = await _token_pool(client, url, headers)
        prefix = [rng.choice(pool) for _ in range(prefix_len)]
        prompts = [
            prefix + [rng.choice(pool) for _ in range(input_len - prefix_len)] for _ in range(num_prompts)
        ]
        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if math.isfinite(request_rate):
                t += rng.expovariate(request_rate)
        gate = asyncio.Semaphore(max_concurrency or num_prompts)
        bar = tqdm(total=num_prompts, desc="requests", unit="req", disable=not progress, file=sys.stderr)
        t0 = time.perf_counter()
        results: list[RequestResult] = []

        async def launch(prompt: list[int], delay: float) -> None:
            await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t0)))
            async with gate:
                result = RequestResult(start=time.perf_counter() - t0)
                results.append(result)
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                await _one(client, url, headers, body, t0, result)
                bar.update(1)

        await asyncio.gather(*(launch(p, d) for p, d in zip(prompts, delays, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(results, duration), results


def format_report(summary: dict) -> str:
    lines = [
        f"{'successful requests':<32}{summary['completed']}",
        f"{'failed requests':<32}{summary['failed']}",
        f"{'duration (s)':<32}{summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':<32}{summary['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<32}{summary['output_token_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<32}{summary['total_token_throughput']:.1f}",
        f"{'':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}   (ms)",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2EL")):
        s = summary[key]
        lines.append(
            f"{name:<10}" + "".join(f"{s[q] * 1000:>10.2f}" for q in ("mean", "median", "p90", "p99"))
        )
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def plot(results: list[RequestResult], path: str, bins: int = 10) -> None:
    """Latency percentiles over the run: requests grouped by when they started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = sorted((r for r in results if r.ok), key=lambda r: r.start)
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    series = (
        ("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
        ("ITL", lambda r: r.itl),
        ("E2E latency", lambda r: [r.latency]),
    )
    end = max((r.start for r in good), default=0.0) or 1.0
    width = end / bins
    for ax, (name, values) in zip(axes, series, strict=True):
        centers, p50, p90, p99 = [], [], [], []
        for b in range(bins):
            lo, hi = b * width, (b + 1) * width
            vals = [
                v * 1000
                for r in good
                if lo <= r.start < hi or (b == bins - 1 and r.start == end)
                for v in values(r)
            ]
            if vals:
                pct = percentiles(vals)
                centers.append((lo + hi) / 2)
                p50.append(pct["median"])
                p90.append(pct["p90"])
                p99.append(pct["p99"])
        ax.plot(centers, p50, marker="o", label="p50")
        ax.plot(centers, p90, marker="o", label="p90")
        ax.plot(centers, p99, marker="o", label="p99")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    axes[-1].set_xlabel("request start (s since the run began)")
    fig.suptitle("flotilla engine bench serve: latency percentiles over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        summary, results = asyncio.run(
            run_benchmark(
                args.url,
                args.num_prompts,
                args.input_len,
                args.output_len,
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                prefix_len=args.prefix_len,
                seed=args.seed,
                model=args.model,
                api_key=args.api_key,
                progress=not args.no_progress,
            )
        )
    except ValueError as exc:
        print(f"flotilla engine bench serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the server is unreachable or not OpenAI-compatible
        print(f"flotilla engine bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(format_report(summary))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1
