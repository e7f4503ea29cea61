"""`flotilla engine bench gpu`: its arithmetic and verdicts on hand-made numbers, its full-size plan (sizes
that exercise what the check promises, within its ten minutes), and a quick run of the whole command on the
CPU (Triton's interpreter for the kernels). No GPU here: the figures of a CPU run mean nothing and are
never compared with the targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flotilla.bench.engine import gpu
from flotilla.bench.engine.gpu_figures import (
    FULL,
    QUICK,
    bandwidth_utilization,
    decode_tokens_per_s,
    verdict,
    verdicts,
)
from flotilla.bench.engine.gpu_kernels import decode_bytes, dtype_skip_reason, gb_per_s, triton_skip_reason
from flotilla.bench.engine.gpu_model import LLAMA_1B, LLAMA_TINY, parameter_count, write_random_llama
from flotilla.bench.engine.hf_generate_batch import active_span, group_by_output_len

CHECK_NAMES = [c.name for c in gpu.CHECKS]


# -- arithmetic ----------------------------------------------------------------------------------------
def test_bandwidth_arithmetic():
    assert gb_per_s(2e9, 1.0) == pytest.approx(2000.0)  # 2 GB in a millisecond
    # 2 GB of weights at 1500 tok/s against a 4300 GB/s copy.
    assert bandwidth_utilization(2e9, 1500.0, 4300.0) == pytest.approx(3000.0 / 4300.0)
    assert bandwidth_utilization(2e9, 1500.0, None) is None
    # The headline decode case: 64 x 4096 tokens of K and V (8 heads of 128, bf16), plus q and out.
    kv = 2 * 64 * 4096 * 8 * 128 * 2
    assert decode_bytes(64, 4096, 32, 8, 128, 2) == kv + 2 * 64 * 32 * 128 * 2
    assert kv >= 1 << 30  # far past the L2 cache: the figure is DRAM bandwidth


def test_decode_rate_leaves_out_the_first_token():
    assert decode_tokens_per_s([10.0, 10.5, 11.0]) == pytest.approx(2.0)
    assert decode_tokens_per_s([10.0]) is None and decode_tokens_per_s([]) is None


def test_verdicts_against_the_targets():
    assert verdict("x", "x", 0.81, 0.8)["passed"] is True
    assert verdict("x", "x", 0.79, 0.8)["passed"] is False
    missing = verdict("x", "x", None, 0.8)
    assert missing["passed"] is None and missing["value"] is None
    assert verdict("x", "x", float("nan"), 0.8)["passed"] is None
    checks = {
        "kernels": {"passed": 3, "failed": 1, "errors": 0},
        "decode_attention_bandwidth": {"headline_copy_bandwidth_ratio": 0.85},
        "batch1_decode": {"bandwidth_utilization": 0.5},
        "throughput_vs_transformers": {},
    }
    rows = {v["name"]: v for v in verdicts(checks)}
    assert rows["kernels"]["value"] == pytest.approx(0.75) and rows["kernels"]["passed"] is False
    assert rows["decode_attention_bandwidth"]["passed"] is True
    assert rows["batch1_decode"]["passed"] is False
    assert rows["throughput_vs_transformers"]["passed"] is None
    assert all(v["passed"] is None for v in verdicts({}))


def test_generate_batch_helpers():
    assert group_by_output_len([8, 4, 8]) == {8: [0, 2], 4: [1]}
    assert active_span([(2.0, 5.0), (1.0, 4.0)]) == pytest.approx(4.0)
    assert active_span([(-1, -1)]) is None


def test_where_triton_runs():
    assert triton_skip_reason("cuda", {}) is None
    assert triton_skip_reason("cpu", {"TRITON_INTERPRET": "1"}) is None
    assert "TRITON_INTERPRET=1" in (triton_skip_reason("cpu", {}) or "")
    assert dtype_skip_reason("bfloat16", "cpu") and dtype_skip_reason("bfloat16", "cuda") is None
    assert dtype_skip_reason("float16", "cpu") is None


# -- the full-size plan --------------------------------------------------------------------------------
def test_full_sizes_cover_what_the_check_promises():
    from flotilla.engine.kernels.triton_attention import MAX_SPLITS, decode_splits

    assert sum(c.budget_s for c in gpu.CHECKS) <= 540  # ten minutes with a minute for start-up
    assert set(FULL.kernel_dtypes) == {"float16", "bfloat16"}
    assert {s.group for s in FULL.decode_shapes} >= {1, 4, 8}
    assert {s.head_dim for s in FULL.decode_shapes} == {64, 128}
    assert {s.block_size for s in FULL.decode_shapes} == {16, 32}
    for shape in FULL.decode_shapes:  # one split, several, and the cap, for every block size
        splits = {decode_splits(max(lens), shape.block_size) for lens in FULL.decode_lens}
        assert 1 in splits and MAX_SPLITS in splits and len(splits) == 3
    assert any(c > 0 for c, _ in FULL.prefill_chunks) and any(c == 0 for c, _ in FULL.prefill_chunks)
    assert FULL.copy_bytes == 1 << 30
    assert QUICK.copy_bytes < FULL.copy_bytes and QUICK.num_prompts < FULL.num_prompts


def test_the_1b_model_and_the_tiny_folder(tmp_path):
    from safetensors import safe_open

    assert 1.0e9 < parameter_count(LLAMA_1B) < 1.1e9  # 1.04B: 2.08 GB in bf16
    folder, reused = write_random_llama(tmp_path / "m", LLAMA_TINY, log=lambda _m: None)
    assert not reused
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert sum(t.numel() for t in tensors.values()) == parameter_count(LLAMA_TINY)
    assert {str(t.dtype) for t in tensors.values()} == {"torch.bfloat16"}
    assert write_random_llama(folder, LLAMA_TINY, log=lambda _m: None) == (folder, True)


# -- the command ---------------------------------------------------------------------------------------
def test_a_failing_check_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    from flotilla.cli import main

    def boom(run, fig):
        fig["measured_before_failing"] = 1.0
        raise RuntimeError("no luck")

    checks = (gpu.Check("kernels", "fails", 5, boom), *[c for c in gpu.CHECKS if c.name == "copy_bandwidth"])
    monkeypatch.setattr(gpu, "CHECKS", checks)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["engine", "bench", "gpu", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    failed, copy = report["checks"]["kernels"], report["checks"]["copy_bandwidth"]
    assert failed["status"] == "error" and "no luck" in failed["error"]
    assert failed["measured_before_failing"] == 1.0
    assert copy["status"] == "ok" and copy["bytes_moved_per_copy"] == 2 * QUICK.copy_bytes


def test_bad_arguments(tmp_path):
    import torch

    from flotilla.cli import main

    base = ["engine", "bench", "gpu", "--out", str(tmp_path)]
    assert main([*base, "--only", "nonsense"]) == 2
    if not torch.cuda.is_available():
        assert main(base) == 2  # --device cuda by default


def test_without_the_interpreter_the_triton_checks_are_skipped_with_the_reason(tmp_path, monkeypatch):
    from flotilla.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    only = "kernels,decode_attention_bandwidth"
    assert (
        main(["engine", "bench", "gpu", "--quick", "--device", "cpu", "--out", str(tmp_path), "--only", only])
        == 0
    )
    checks = json.loads((tmp_path / "gpu-check.json").read_text())["checks"]
    for name in only.split(","):
        assert checks[name]["status"] == "skipped" and "TRITON_INTERPRET=1" in checks[name]["reason"]
    assert checks["model"]["status"] == "skipped" and checks["model"]["reason"] == "not selected (--only)"


def test_quick_run_on_the_cpu_end_to_end(tmp_path):
    """The whole command in a fresh process with TRITON_INTERPRET=1 (set before triton is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "flotilla.cli", "engine", "bench", "gpu", "--quick", "--device", "cpu",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "smoke-run figure" in proc.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = report["checks"]
    assert list(checks) == CHECK_NAMES
    assert all(c["status"] == "ok" and c["summary"] for c in checks.values()), checks
    assert report["sizes"]["model"] == "llama-tiny" and report["environment"]["device_type"] == "cpu"

    kernels = checks["kernels"]
    assert kernels["passed"] == len(kernels["cases"]) == kernels["planned"] > 0
    assert {c["kernel"] for c in kernels["cases"]} == {"decode", "prefill", "store_kv"}
    assert any(c.get("splits", 1) > 1 for c in kernels["cases"])
    assert "raw bits" in kernels["skipped_dtypes"]["bfloat16"]

    attention = checks["decode_attention_bandwidth"]
    assert attention["headline_copy_bandwidth_ratio"] > 0
    assert attention["copy_gb_per_s"] == checks["copy_bandwidth"]["gb_per_s"]

    batch1 = checks["batch1_decode"]
    assert batch1["weight_bytes"] == 4 * parameter_count(LLAMA_TINY)  # float32 on the CPU, tied once
    assert all(r["output_tokens"] == QUICK.batch1_output_len for r in batch1["runs"])
    assert batch1["bandwidth_utilization"] > 0

    graphs = checks["cuda_graphs"]  # off CUDA: the graph path's buffers and padding, run eagerly
    assert graphs["identical_tokens"] is True and graphs["captured_sizes"] == []
    assert graphs["graphs_decode_tokens_per_s"] > 0 and graphs["eager_decode_tokens_per_s"] > 0

    assert [v["name"] for v in report["verdicts"]] == [
        "kernels", "decode_attention_bandwidth", "batch1_decode", "throughput_vs_transformers",
    ]  # fmt: skip
    assert all(v["value"] is not None for v in report["verdicts"][:3])
    assert (tmp_path / "gpu-check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    throughput = checks["throughput_vs_transformers"]
    assert throughput["flotilla"]["output_tokens"] == QUICK.num_prompts * QUICK.output_len
    assert throughput["speedup_vs_hf_sequential"] > 0 and throughput["speedup_vs_hf_static_batch"] > 0
    batch = throughput["hf_generate_batch"]
    if not batch["available"]:  # an older transformers: recorded, not measured
        assert "no generate_batch" in batch["reason"]
        return
    assert batch["output_tokens"] == batch["expected_output_tokens"] and batch["failed_requests"] == 0
    assert throughput["speedup_vs_hf_generate_batch"] > 0

    assert report["verdicts"][-1]["value"] is not None
