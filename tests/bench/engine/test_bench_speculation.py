"""`flotilla engine bench offline --report speculation` runs end to end on a tiny preset that drafts for
itself (so every greedy draft is accepted), writes JSON and a PNG, and says whether outputs stayed the
same; timings are printed, never asserted. The verdicts are pure and tested directly."""

from __future__ import annotations

import json

from flotilla.bench.engine.speculation_figures import format_report, verdicts


def test_the_report_compares_each_method_with_none(tiny_preset, tmp_path, capsys):
    from flotilla.cli import main

    out, png = tmp_path / "speculation.json", tmp_path / "speculation.png"
    args = ["engine", "bench", "offline", "--report", "speculation", "--model", str(tiny_preset),
            "--draft-model", str(tiny_preset), "--spec-tokens", "2", "--spec-prompts", "2",
            "--spec-max-tokens", "6", "--spec-full-batch", "3", "--spec-repeats", "1",
            "--block-size", "4", "--kv-cache-memory", str(1 << 22), "--threads", "1",
            "--json", str(out), "--png", str(png)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    rows = {(r["method"], r["k"]): r for r in report["rows"]}
    assert list(rows) == [("none", None), ("ngram", 2), ("draft", 2)]
    for (method, _k), row in rows.items():
        assert row["output_tokens"] > 0 and row["batch1_tokens_per_s"] > 0
        assert row["full_batch_tokens_per_s"] > 0
        if method != "none":
            assert row["identical_to_none"] is True
            assert "full_batch_forced_ratio" in row
    draft = rows[("draft", 2)]
    assert draft["acceptance_rate"] == 1.0  # the model drafts for itself, greedily
    # Per position, over all drafts: near max_tokens a draft is cut to one token, so the second is lower.
    assert draft["acceptance_per_position"][0] == 1.0 and 0 < draft["acceptance_per_position"][1] <= 1.0
    assert report["verdicts"]["all_identical"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "greedy outputs identical to none" in capsys.readouterr().out


def row(method, k, b1, full, identical=True):
    return {
        "method": method,
        "k": k,
        "batch1_speedup": b1,
        "full_batch_ratio": full,
        "identical_to_none": identical,
    }


def test_verdicts_pick_the_best_batch1_and_the_worst_full_batch():
    report = {"rows": [row("none", None, 1.0, 1.0), row("ngram", 2, 1.6, 0.97), row("draft", 4, 1.2, 0.9)]}
    v = verdicts(report)
    assert v["best_batch1"] == "ngram K=2" and v["batch1_met"]
    assert v["worst_full_batch_ratio"] == 0.9 and not v["full_batch_met"]
    report["rows"][2]["identical_to_none"] = False
    assert verdicts(report)["all_identical"] is False


def test_the_table_says_when_a_target_is_missed():
    rows = [row("none", None, 1.0, 1.0), row("ngram", 2, 1.1, 1.0)]
    for r, rate in zip(rows, (100.0, 110.0), strict=True):
        r.update(batch1_tokens_per_s=rate, full_batch_tokens_per_s=500.0, acceptance_rate=None if r["k"] is None else 0.3,
                 mean_accepted_length=None if r["k"] is None else 1.4, acceptance_per_position=[], output_tokens=10)  # fmt: skip
    report = {"model": "m", "draft_model": None, "device": "cpu", "threads": 1, "prompts": 2, "max_tokens": 8,
              "repeats": 1, "full_batch": 32, "speculative_max_batch_size": 4, "rows": rows}  # fmt: skip
    report["verdicts"] = verdicts(report)
    text = format_report(report)
    assert "target >= 1.5x: MISSED" in text and "floor 0.95x: met" in text
