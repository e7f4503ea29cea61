"""The bench command runs end to end on a tiny model and writes every figure to JSON (timings are
printed, never asserted)."""

from __future__ import annotations

import json


def test_bench_offline_writes_its_figures(hf_models, tmp_path, capsys):
    from flotilla.cli import main

    folder, _ = hf_models("llama-gqa")
    out = tmp_path / "bench.json"
    args = ["engine", "bench", "offline", "--model", str(folder), "--num-prompts", "4", "--input-len", "4:8",
            "--output-len", "2:4", "--compare", "hf", "--hf-sequential-prompts", "2", "--max-num-seqs", "2",
            "--prefix-requests", "3", "--prefix-len", "8", "--budget-sequences", "2", "--block-size", "4",
            "--kv-cache-memory", str(1 << 20), "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    for key in ("hf_sequential", "hf_static_batch", "flotilla"):
        assert report[key]["output_tokens"] > 0 and report[key]["tokens_per_s"] > 0
    assert report["hf_static_batch"]["output_tokens"] == report["flotilla"]["output_tokens"]
    assert 0 < report["flotilla"]["kv_slot_utilization"] <= 1
    fit = report["sequences_per_kv_budget"]
    assert fit["paged_peak_concurrent_sequences"] > fit["contiguous_max_len_sequences"]
    assert report["prefix_cache"]["with_cache"]["prefix_cache_hit_rate"] > 0
    assert report["scheduler"]["running_sequences"] == 256
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "ms/step" in printed


def test_bad_ranges_are_rejected():
    import pytest

    from flotilla.bench.engine.offline import parse_range

    assert parse_range("3:9") == (3, 9) and parse_range("5") == (5, 5)
    for bad in ("9:3", "x:1", "0:4"):
        with pytest.raises(ValueError, match="range"):
            parse_range(bad)
