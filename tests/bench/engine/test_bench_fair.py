"""`flotilla engine bench fair`: its figures on hand-made numbers, and one smoke run of the whole command
on a tiny model (every request accounted for; timings are printed, never asserted)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from flotilla.bench.engine.fair import make_schedule
from flotilla.bench.engine.fair_figures import (
    RequestRecord,
    compare,
    jain_index,
    max_min_shares,
    percentile,
    summarize,
)


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.95) == pytest.approx(4.8)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 5.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_jain_index():
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)  # one tenant has everything: 1/n
    assert jain_index([1.0, 0.5]) == pytest.approx(2.25 / 2.5)
    assert math.isnan(jain_index([0.0, 0.0])) and math.isnan(jain_index([]))


def test_max_min_shares_fill_the_small_demand_first():
    # 10:1 demand past capacity: the quiet tenant gets all it asked for, the loud one the rest.
    assert max_min_shares({"loud": 1000.0, "quiet": 100.0}, 600.0) == {"quiet": 100.0, "loud": 500.0}
    # Both ask for more than half: an equal split.
    assert max_min_shares({"a": 400.0, "b": 900.0}, 600.0) == {"a": 300.0, "b": 300.0}
    # Capacity to spare: everyone gets their demand.
    assert max_min_shares({"a": 10.0, "b": 20.0}, 100.0) == {"a": 10.0, "b": 20.0}


_ids = itertools.count()


def _record(tenant, arrival, demanded, ttft, out, window, finished=True):
    return RequestRecord(f"{tenant}-{next(_ids)}", tenant, arrival, demanded, ttft, out, window, finished)


def test_summarize_hand_made_run():
    records = [
        # loud: demands 1000 tokens, 500 served in the window
        _record("loud", 0.0, 500, 0.1, 500, 400),
        _record("loud", 1.0, 500, 0.3, 500, 100),
        # quiet: demands 100, all served in the window; one request never started (censored TTFT)
        _record("quiet", 0.5, 60, 0.2, 60, 60),
        _record("quiet", 2.0, 40, 0.4, 40, 40),
        _record("quiet", 8.0, 10, None, 0, 0, finished=False),
    ]
    s = summarize(records, duration=10.0, end=20.0)
    assert (s["offered"], s["finished"], s["unfinished"]) == (5, 4, 1)
    assert s["output_tokens"] == 1100 and s["window_tokens"] == 600
    assert s["throughput_tok_s"] == pytest.approx(1100 / 20.0)
    assert s["window_throughput_tok_s"] == pytest.approx(60.0)
    quiet, loud = s["tenants"]["quiet"], s["tenants"]["loud"]
    assert quiet["without_first_token"] == 1 and quiet["unfinished"] == 1
    # TTFTs 0.2, 0.4 and the censored 20 - 8 = 12
    assert quiet["ttft_s"]["p50"] == pytest.approx(0.4)
    assert quiet["ttft_s"]["p95"] == pytest.approx(0.4 + (12 - 0.4) * 0.9)
    assert loud["ttft_s"]["p50"] == pytest.approx(0.2)
    assert quiet["token_share"] == pytest.approx(100 / 600) and loud["token_share"] == pytest.approx(
        500 / 600
    )
    assert quiet["token_share_run"] == pytest.approx(100 / 1100)
    # max-min shares of the 600 window tokens: quiet 110 (its demand), loud 490
    assert quiet["fair_share_tokens"] == pytest.approx(110) and loud["fair_share_tokens"] == pytest.approx(
        490
    )
    x = [500 / 490, 100 / 110]
    assert s["jain_index"] == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))


def test_max_min_service_is_perfectly_fair_and_proportional_is_not():
    def run(loud_window, quiet_window):
        return summarize(
            [_record("loud", 0.0, 1000, 1.0, loud_window, loud_window), _record("quiet", 0.0, 100, 1.0, quiet_window, quiet_window)],
            duration=10.0,
            end=10.0,
        )  # fmt: skip

    assert run(500, 100)["jain_index"] == pytest.approx(1.0)  # quiet got all it asked for
    proportional = run(545, 55)["jain_index"]  # fcfs-like: served in proportion to demand
    assert proportional < 0.99


def test_compare_against_the_targets():
    def summary(quiet_p95, throughput):
        return {"tenants": {"quiet": {"ttft_s": {"p95": quiet_p95}}}, "throughput_tok_s": throughput}

    c = compare(summary(10.0, 100.0), summary(1.0, 97.0))
    assert c["quiet_ttft_p95_fcfs_over_fair"] == pytest.approx(10.0) and c["quiet_ttft_p95_met"]
    assert c["throughput_fair_over_fcfs"] == pytest.approx(0.97) and c["throughput_met"]
    c = compare(summary(4.0, 100.0), summary(1.0, 90.0))
    assert not c["quiet_ttft_p95_met"] and not c["throughput_met"]


def test_schedule_is_deterministic_and_per_tenant():
    a = make_schedule(10.0, {"loud": 5.0, "quiet": 0.5}, (4, 8), (2, 6), 100, seed=3)
    b = make_schedule(10.0, {"loud": 50.0, "quiet": 0.5}, (4, 8), (2, 6), 100, seed=3)
    assert a == make_schedule(10.0, {"loud": 5.0, "quiet": 0.5}, (4, 8), (2, 6), 100, seed=3)
    assert [x.at for x in a] == sorted(x.at for x in a) and all(0 <= x.at < 10.0 for x in a)
    # The quiet tenant's requests do not depend on the loud tenant's rate.
    assert [x for x in a if x.tenant == "quiet"] == [x for x in b if x.tenant == "quiet"]
    assert all(4 <= len(x.prompt) <= 8 and 2 <= x.output_len <= 6 for x in a)


def test_bench_fair_smoke(hf_models, tmp_path, capsys):
    from flotilla.cli import main

    folder, _ = hf_models("llama-gqa")
    out, png = tmp_path / "fair.json", tmp_path / "fair.png"
    args = ["engine", "bench", "fair", "--model", str(folder), "--duration", "2", "--calibration-seconds", "0.5",
            "--input-len", "4:8", "--output-len", "2:6", "--max-num-seqs", "4", "--block-size", "4",
            "--kv-cache-memory", str(1 << 20), "--threads", "1", "--drain-limit", "1.5",
            "--json", str(out), "--png", str(png)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["calibration"]["capacity_tok_s"] > 0
    offered = report["rates"]["loud_requests"] + report["rates"]["quiet_requests"]
    assert offered > 0
    assert set(report["runs"]) == {"fcfs", "fair"}
    for run in report["runs"].values():
        for key in ("throughput_tok_s", "window_throughput_tok_s", "jain_index", "run_s", "output_tokens"):
            assert key in run
        assert run["offered"] == offered == len(run["requests"])
        assert run["finished"] + run["unfinished"] == offered
        assert sum(t["finished"] + t["unfinished"] for t in run["tenants"].values()) == offered
        for tenant in run["tenants"].values():
            assert set(tenant["ttft_s"]) == {"mean", "p50", "p95", "p99"}
            assert "token_share" in tenant and "served_over_fair_share" in tenant
        done = [r for r in run["requests"] if r["finished"]]
        assert all(r["output_tokens"] == r["demanded_tokens"] for r in done)
    for key in (
        "quiet_ttft_p95_fcfs_over_fair",
        "quiet_ttft_p95_met",
        "throughput_fair_over_fcfs",
        "throughput_met",
    ):
        assert key in report["comparison"]
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "quiet TTFT p95" in printed and "Jain" in printed


def test_bad_flags_are_refused_before_any_engine_starts(tmp_path, capsys):
    from flotilla.cli import main

    base = ["engine", "bench", "fair", "--model", str(tmp_path / "absent")]
    assert main([*base, "--policies", "fcfs,lifo"]) == 2
    assert main([*base, "--output-len", "9:3"]) == 2
    assert main([*base, "--drain-limit", "0.5"]) == 2
    assert main([*base, "--calibration-seconds", "0"]) == 2
    assert "--calibration-seconds 0 needs --quiet-rate" in capsys.readouterr().err
