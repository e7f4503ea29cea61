"""The KV cache's memory: zeros like torch.zeros, in huge pages where Linux gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flotilla.engine.kernels import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_zeros_are_zeros_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        t = huge_pages.zeros((3, 16, 2, 8), dtype, torch.device("cpu"))
        assert t.shape == (3, 16, 2, 8) and t.dtype == dtype and not t.any()


def test_memory_smaller_than_a_huge_page_is_left_alone():
    assert huge_pages.advise_huge_pages(torch.empty(1000)) is False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off on this host",
)
def test_the_kernel_takes_the_advice_and_maps_huge_pages():
    before = _anon_huge_kib()
    t = torch.empty(64 << 20, dtype=torch.uint8)
    assert huge_pages.advise_huge_pages(t)
    t.zero_()
    # Advised memory is compacted for on the first touch (defrag's default, `madvise`), so the 31 whole
    # 2 MiB pages inside come as huge pages.
    assert _anon_huge_kib() - before >= 16 * 2048
    assert not t.any()


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0
