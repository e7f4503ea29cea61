"""The KV caches' storage: zeros on every device, and on the CPU no memory until a block is written."""

from __future__ import annotations

import pytest
import torch

from flotilla.engine.worker.kv_storage import zeroed


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_caches_are_zeros_that_hold_no_memory_until_written():
    shape = (4096, 16, 4, 64)  # 512 MiB of float32
    before = _resident_bytes()
    cache = zeroed(shape, torch.float32, torch.device("cpu"))
    assert _resident_bytes() - before < 64 << 20  # nothing was written, so next to nothing is resident
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    cache[7].fill_(2.5)  # a block written, as a KV store writes one
    assert bool((cache[7] == 2.5).all())
    assert bool((cache[:7] == 0).all()) and bool((cache[8:64] == 0).all())


def test_every_dtype_and_an_empty_shape():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cache = zeroed((3, 16, 2, 8), dtype, torch.device("cpu"))
        assert cache.dtype == dtype and bool((cache == 0).all())
    assert zeroed((0, 16, 2, 8), torch.float32, torch.device("cpu")).shape == (0, 16, 2, 8)


def test_a_budget_past_what_the_machine_can_map_is_refused_naming_the_knob(tiny_preset):
    """1 PiB: past x86-64's 128 TiB of user address space, so refused whatever the overcommit setting."""
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tiny_preset), device="cpu", dtype="float32", kv_cache_memory=1 << 50,
                          show_progress=False)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"kv_cache_memory: one layer's \d+ bytes of KV cache .* could not be mapped"
    ):
        LLMEngine(config)
