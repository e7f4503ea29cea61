"""`flotilla engine bench serve` against the real server: its figures, its files, and its TTFTs against
the server's own TTFT histogram.

Latencies depend on how busy the machine is, so no test here compares two of them for closeness; they
compare counts, and the one ordering load cannot change (the client's clock runs around the server's).
"""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

TTFT = "flotilla_time_to_first_token_seconds"
E2E = "flotilla_e2e_request_latency_seconds"
ITL = "flotilla_inter_token_latency_seconds"


def histograms(url: str) -> dict[str, list[tuple[float, float]]]:
    """name -> its cumulative buckets [(le, count)], +Inf last."""
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return {
        family.name: [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
        for family in text_string_to_metric_families(text)
        if family.type == "histogram"
    }


def added(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The cumulative buckets of what was observed between two scrapes."""
    return [(le, a - b) for (le, a), (_, b) in zip(after, before, strict=True)]


def test_bench_counts_match_the_server_and_no_client_ttft_undercuts_it(server):
    from flotilla.bench.engine.serve import run_benchmark

    requests, output_len = 24, 6
    before = histograms(server.url)
    summary, results = asyncio.run(
        run_benchmark(
            server.url,
            num_prompts=requests,
            input_len=24,
            output_len=output_len,
            max_concurrency=4,
            progress=False,
        )
    )
    after = histograms(server.url)

    # The bench's own figures count every request and token.
    assert summary["completed"] == requests and summary["failed"] == 0 and len(results) == requests
    assert summary["total_output_tokens"] == requests * output_len
    assert all(r.ok and r.output_tokens == output_len and r.ttft is not None for r in results)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert set(summary[key]) == {"mean", "median", "p90", "p99"}

    # The server saw exactly those requests: one TTFT and one end-to-end latency each, and a gap per
    # token after the first.
    ttft = added(before[TTFT], after[TTFT])
    assert ttft[-1] == (float("inf"), requests)
    assert added(before[E2E], after[E2E])[-1][1] == requests
    assert added(before[ITL], after[ITL])[-1][1] == requests * (output_len - 1)

    # Per request, the client's TTFT spans the server's (it starts before the request is sent and ends
    # after the first token arrives), so however busy the machine, client TTFT >= server TTFT. The
    # server's values are only in buckets, so check what that implies at every bucket edge: no more
    # client TTFTs are <= the edge than server TTFTs are. (At the edges below the server's lowest
    # non-empty bucket this says no client TTFT is that small.)
    client = [r.ttft for r in results]
    for le, server_count in ttft:
        client_count = sum(1 for t in client if t <= le)
        assert client_count <= server_count, (le, client_count, server_count, sorted(client))


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
