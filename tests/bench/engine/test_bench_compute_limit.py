"""The compute-limit figures of `bench offline`: FLOPs per token by hand, profile rows into categories,
and the path end to end on the tiny preset (timings are never asserted)."""

from __future__ import annotations

import json

import pytest

from flotilla.bench.engine.compute_limit import (
    CATEGORIES,
    ProfileRow,
    attention_flops_per_token,
    category,
    group_profile,
    mean_decode_context,
    model_flops_per_token,
)
from flotilla.engine.kernels.attention import ATTENTION_LABEL
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.worker.sampler import SAMPLER_LABEL

SMALL = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 16,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)


def test_model_flops_per_token_by_hand():
    # head_dim 16/4 = 4: q 16x16, k and v 16x8 each, o 16x16; gate and up 16x40 each, down 40x16.
    attention = 16 * 16 + 2 * 16 * 8 + 16 * 16  # 768
    mlp = 3 * 16 * 40  # 1920
    lm_head = 16 * 100  # 1600; the embedding (also 1600) is a lookup and counts nothing
    assert model_flops_per_token(SMALL) == 2 * (3 * (attention + mlp) + lm_head) == 19328
    # Attention's own FLOPs, apart: q.k and p.v, 2 FLOPs each per head dim, per context token and head.
    assert attention_flops_per_token(SMALL, 10) == 3 * 4 * (2 * 4 * 10 + 2 * 4 * 10)


def test_mean_decode_context():
    # Prompt 3, 2 outputs: contexts 3 and 4; prompt 5, 1 output: 5.
    assert mean_decode_context([3, 5], [2, 1]) == pytest.approx((3 + 4 + 5) / 3)


def test_profile_rows_group_into_categories():
    rows = [
        ProfileRow("aten::mm", 500, ("aten::matmul", "aten::linear")),
        ProfileRow("aten::t", 20, ("aten::linear",)),
        ProfileRow("aten::addmm", 100),
        ProfileRow(ATTENTION_LABEL, 50),
        ProfileRow("aten::bmm", 200, ("aten::matmul", "aten::scaled_dot_product_attention", ATTENTION_LABEL)),
        ProfileRow("aten::index_copy_", 30, (ATTENTION_LABEL,)),
        ProfileRow("aten::argmax", 40, (SAMPLER_LABEL,)),
        ProfileRow("aten::mul", 60, ("aten::silu",)),
        ProfileRow("aten::rsqrt", 0),
    ]
    assert [category(r) for r in rows] == ["linear", "linear", "linear", "attention", "attention",
                                           "attention", "sampling", "other_ops", "other_ops"]  # fmt: skip
    result = group_profile(rows, wall_s=0.002)
    seconds = result["seconds"]
    assert set(seconds) == set(CATEGORIES)
    assert seconds["linear"] == pytest.approx(620e-6)
    assert seconds["attention"] == pytest.approx(280e-6)
    assert seconds["sampling"] == pytest.approx(40e-6)
    assert seconds["other_ops"] == pytest.approx(60e-6)
    assert seconds["python"] == pytest.approx(0.002 - 1000e-6)
    assert sum(result["shares"].values()) == pytest.approx(1.0)
    # Op time past the wall time (clock skew) leaves python at 0 and the shares still sum to 1.
    skewed = group_profile(rows, wall_s=0.0005)
    assert skewed["seconds"]["python"] == 0 and sum(skewed["shares"].values()) == pytest.approx(1.0)


def test_bench_offline_reports_the_compute_limit(tiny_preset, tmp_path, capsys):
    from flotilla.cli import main

    out = tmp_path / "bench.json"
    args = ["engine", "bench", "offline", "--model", str(tiny_preset), "--num-prompts", "3", "--input-len", "4:8",
            "--output-len", "3:5", "--max-num-seqs", "3", "--prefix-requests", "0", "--budget-sequences", "2",
            "--block-size", "4", "--kv-cache-memory", str(1 << 22), "--threads", "1", "--profile-steps", "2",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    c = report["compute_limit"]
    for key in ("tokens_per_s", "model_flops_per_token", "matmul_gflops", "compute_limit_tokens_per_s",
                "compute_limit_ratio", "linear_flops_utilization"):  # fmt: skip
        assert c[key] > 0, key
    assert c["tokens_per_s"] == report["flotilla"]["tokens_per_s"] and c["tokens_counted"] == "output"
    assert c["model_flops_per_token"] == model_flops_per_token(
        ModelConfig.from_file(tiny_preset / "config.json")
    )
    b = report["step_breakdown"]
    assert 1 <= b["steps"] <= 2 and set(b["shares"]) == set(CATEGORIES)
    assert sum(b["shares"].values()) == pytest.approx(1.0)
    assert b["seconds"]["linear"] > 0 and b["seconds"]["attention"] > 0 and b["seconds"]["sampling"] > 0
    printed = capsys.readouterr().out
    assert "compute limit" in printed and "step breakdown" in printed
