"""`flotilla engine bench serve` against the real server: its figures, its files, and its TTFT median
against the server's own TTFT histogram."""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families


def ttft_buckets(url: str) -> list[tuple[float, float]]:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    for family in text_string_to_metric_families(text):
        if family.name == "flotilla_time_to_first_token_seconds":
            return [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
    raise AssertionError("no TTFT histogram")


def test_ttft_median_agrees_with_the_server_histogram(server):
    from flotilla.engine.bench.serve import run_benchmark

    before = ttft_buckets(server.url)
    summary, results = asyncio.run(
        run_benchmark(
            server.url, num_prompts=24, input_len=24, output_len=6, max_concurrency=4, progress=False
        )
    )
    after = ttft_buckets(server.url)
    assert summary["completed"] == 24 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 24 * 6
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert set(summary[key]) == {"mean", "median", "p90", "p99"}
    cumulative = [(le, a - b) for (le, a), (_, b) in zip(after, before, strict=True)]
    total = cumulative[-1][1]
    assert total == 24
    # The bucket that holds the server's median; the bench (which adds HTTP time and may see its first
    # token a chunk later) must fall in it or in a neighbour: agreement within the bucket resolution.
    edges = [0.0] + [le for le, _ in cumulative]
    i = next(k for k, (_, count) in enumerate(cumulative) if count >= total / 2)
    low, high = edges[max(0, i - 1)], edges[min(len(edges) - 1, i + 2)]
    assert low <= summary["ttft_s"]["median"] <= high, (summary["ttft_s"], edges[i], edges[i + 1])


def test_cli_writes_json_and_plot(server, tmp_path, capsys):
    from flotilla.cli import main

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["engine", "bench", "serve", "--url", server.url, "--num-prompts", "6", "--input-len", "12",
                 "--output-len", "4", "--prefix-len", "8", "--request-rate", "50", "--seed", "3",
                 "--json", str(out), "--plot", str(png), "--no-progress"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "output token throughput" in printed
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 6 and len(data["requests"]) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_an_unreachable_server(capsys):
    from flotilla.cli import main

    assert (
        main(
            ["engine", "bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-progress"]
        )
        == 1
    )
    assert "bench serve" in capsys.readouterr().err
