"""`flotilla engine bench lora` runs end to end on a tiny preset, writes JSON and a PNG, and reports every
adapter count against the base; timings are printed, never compared."""

from __future__ import annotations

import json


def test_the_lora_bench_reports_each_adapter_count_against_the_base(tiny_preset, tmp_path, capsys):
    from flotilla.cli import main

    out, png = tmp_path / "lora.json", tmp_path / "lora.png"
    args = ["engine", "bench", "lora", "--model", str(tiny_preset), "--adapters", "1,2", "--rank", "4",
            "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--rounds", "1", "--threads", "1",
            "--json", str(out), "--png", str(png)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [row["adapters"] for row in report["rows"]] == [0, 1, 2]
    assert report["rows"][0]["ratio_to_base"] == 1.0
    assert all(row["tok_s"] > 0 and len(row["tok_s_per_round"]) == 1 for row in report["rows"])
    # A slot is sized for the max rank (4) over every linear layer; the host copy holds the same widths.
    assert report["slot_bytes"] > 0 and report["adapter_host_bytes"] == report["slot_bytes"]
    assert report["load_to_first_token_seconds"] >= report["load_seconds"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "x base" in capsys.readouterr().out
