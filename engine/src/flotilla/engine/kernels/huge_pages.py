"""The KV cache's host memory in transparent huge pages (2 MiB) on Linux.

Decode attention reads each request's blocks, scattered over a cache of hundreds of MiB. In 4 KiB pages
every 4 KiB of a block is a TLB miss, and the hardware prefetcher stops at each page's end, so the compiled
decode kernel waited on memory: at 48 running requests it took 2.8 ms per layer where the same work in a
small, warm cache took 1.6 ms. Most kernels hand huge pages only to memory that asks for them
(`transparent_hugepage` = madvise), which is what this does before the cache is first written.
Where madvise is missing or refused (another OS, THP off), the cache is ordinary memory: nothing fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks for huge pages over the whole 2 MiB pages inside `tensor`'s memory (before it is touched: a
    page already faulted in stays small). True if the kernel took the advice."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, in huge pages where the host allows them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
