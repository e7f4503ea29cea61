"""`flotilla engine bench offline --report quantization` runs every method end to end on a tiny random
preset and writes its figures to JSON and a PNG (timings are printed, never asserted); the agreement
figures and the skipped group sizes are pure and tested directly."""

from __future__ import annotations

import json
import math

import pytest

from flotilla.bench.engine.quantization import plan_methods
from flotilla.bench.engine.quantization_figures import (
    BYTES_TARGETS,
    format_report,
    greedy_agreement,
    method_name,
    plot,
)
from flotilla.engine.model.config import ModelConfig

AGREEMENT_TOKENS = 4
DECODE_TOKENS = 3


def test_the_report_measures_every_method(tiny_preset, tmp_path, capsys):
    from flotilla.cli import main

    out, png = tmp_path / "quantization.json", tmp_path / "quantization.png"
    args = ["engine", "bench", "offline", "--report", "quantization", "--model", str(tiny_preset),
            "--perplexity-documents", "2", "--agreement-prompts", "2", "--agreement-tokens", str(AGREEMENT_TOKENS),
            "--decode-batch-sizes", "1,2", "--decode-tokens", str(DECODE_TOKENS), "--decode-repeats", "1",
            "--block-size", "4", "--kv-cache-memory", str(1 << 22), "--threads", "1",
            "--json", str(out), "--png", str(png)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    methods = {m["name"]: m for m in report["methods"]}
    # tiny-qwen2's layers (512 and 1664 input features) take every group size.
    assert list(methods) == ["none", "int8", "int4-g32", "int4-g64", "int4-g128"]
    assert report["perplexity_tokens"] > 0
    for name, m in methods.items():
        assert m["skipped"] is None
        ppl = m["perplexity"]
        assert ppl["perplexity"] is not None and math.isfinite(ppl["perplexity"]) and ppl["perplexity"] > 1
        assert ppl["tokens"] == report["perplexity_tokens"]  # the same text, the same tokenizer
        agreement = m["agreement"]
        assert 0 <= agreement["fraction_until_divergence"] <= 1
        assert 0 <= agreement["mean_matching_prefix"] <= AGREEMENT_TOKENS
        assert agreement["positions"] == 2 * AGREEMENT_TOKENS
        assert set(m["decode"]) == {"1", "2"}
        for batch, speed in m["decode"].items():
            assert speed["output_tokens"] == int(batch) * DECODE_TOKENS and speed["tokens_per_s"] > 0
        assert m["bytes"]["weight_bytes"] > 0
        if name == "none":
            assert agreement["reference"] and agreement["fraction_until_divergence"] == 1.0
            assert agreement["mean_matching_prefix"] == AGREEMENT_TOKENS
            assert m["bytes"]["target"] is None and m["kernels"] == {}
            assert m["bytes"]["layers_bf16_ratio"] == 2.0  # float32 weights on CPU
        else:
            assert not agreement["reference"]
            assert 0 < m["bytes"]["layers_bf16_ratio"] < 1
            assert m["bytes"]["target"] == BYTES_TARGETS[m["quantization"]]
            assert m["bytes"]["met"] == (m["bytes"]["layers_bf16_ratio"] <= m["bytes"]["target"])
            assert sum(m["kernels"].values()) == 4 * 6  # every decoder layer's four linear layers
    assert methods["int4-g32"]["bytes"]["met"] is False  # 0.3125x: the scales and zeros
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "int4-g128" in printed and "<= 0.55" in printed and "<= 0.30" in printed
    assert "int4-g32 cannot meet 0.30x" in printed
    # A skipped method prints its reason in the table and stays out of the plot.
    report["methods"][-1] = {"name": "int4-g128", "quantization": "int4", "group_size": 128, "skipped": "why"}
    assert "  int4-g128 skipped: why" in format_report(report).splitlines()
    plot(report, str(tmp_path / "skipped.png"))


def test_a_group_size_that_does_not_divide_the_layers_is_skipped_naming_the_rule(hf_models):
    folder, _ = hf_models("llama-gqa")  # down_proj has 96 input features: only groups of 32 divide them
    plan = plan_methods(ModelConfig.from_file(folder / "config.json"))
    assert [method_name(q, g) for q, g, _ in plan] == ["none", "int8", "int4-g32", "int4-g64", "int4-g128"]
    skipped = {method_name(q, g): reason for q, g, reason in plan if reason is not None}
    assert set(skipped) == {"int4-g64", "int4-g128"}
    assert "does not divide" in skipped["int4-g64"] and "32 would" in skipped["int4-g64"]


def test_agreement_counts_matches_until_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = greedy_agreement(reference, [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got["matching_prefixes"] == [2, 4]  # the 4 after the difference does not count
    assert got["fraction_until_divergence"] == 6 / 8 and got["mean_matching_prefix"] == 3.0
    assert got["identical_outputs"] == 1
    assert greedy_agreement(reference, reference)["fraction_until_divergence"] == 1.0
    with pytest.raises(ValueError, match="2 reference outputs but 1"):
        greedy_agreement(reference, reference[:1])
