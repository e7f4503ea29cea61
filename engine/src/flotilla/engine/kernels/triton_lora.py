"""Triton kernels for CUDA that add each segment's LoRA update to a linear layer's output, every segment
of the batch in one launch per half (the segmented "shrink" and "expand" of Punica/S-LoRA): shrink
writes x[rows] @ A[slot, :width].T into a [tokens, max width] scratch, expand adds scratch @ Bt[slot,
:width] into the output. A program takes BLOCK_M rows of one segment (and, in expand, BLOCK_N output
columns); a segment's slot and that slot's width in this layer come from two small tensors, so the
launch does not change with the batch's adapters. Tested on the CPU under TRITON_INTERPRET=1 against
lora.reference_add_lora.

Every `tl.dot` has all dimensions >= 16 (MIN_DOT), as real GPUs need; rows, ranks and columns past the
ends are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT = 16
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _shrink(x_ptr, a_ptr, xa_ptr, seg_ptr, widths_ptr, stride_x, stride_as, stride_ar, stride_xa, K,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_ptr + seg * 3)
    end = tl.load(seg_ptr + seg * 3 + 1)
    slot = tl.load(seg_ptr + seg * 3 + 2)
    width = tl.load(widths_ptr + slot)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < width
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
                    mask=rank_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(
        xa_ptr + rows[:, None] * stride_xa + ranks[None, :], acc, mask=row_ok[:, None] & rank_ok[None, :]
    )


@triton.jit
def _expand(xa_ptr, bt_ptr, out_ptr, seg_ptr, widths_ptr, stride_xa, stride_bs, stride_br, stride_out, N,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_ptr + seg * 3)
    end = tl.load(seg_ptr + seg * 3 + 1)
    slot = tl.load(seg_ptr + seg * 3 + 2)
    width = tl.load(widths_ptr + slot)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < width
    xa = tl.load(
        xa_ptr + rows[:, None] * stride_xa + ranks[None, :],
        mask=row_ok[:, None] & rank_ok[None, :],
        other=0.0,
    )
    bt = tl.load(bt_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
                 mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    update = tl.dot(xa, bt.to(tl.float32))
    mask = row_ok[:, None] & col_ok[None, :]
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    current = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (current.to(tl.float32) + update).to(current.dtype), mask=mask)


def segment_table(segments, device: torch.device) -> tuple[torch.Tensor, int]:
    """The segments as an int32 [n, 3] tensor (start, end, slot) and the longest segment's length."""
    table = torch.tensor([list(s) for s in segments], dtype=torch.int32, device=device).reshape(-1, 3)
    longest = max((end - start for start, end, _slot in segments), default=0)
    return table, longest


def triton_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    bt_stack: torch.Tensor,
    widths: torch.Tensor,
    table: torch.Tensor,
    longest: int,
) -> torch.Tensor:
    """out[s:e] += (x[s:e] @ A[slot, :w].T) @ Bt[slot, :w] for each row of `table` (start, end, slot),
    w = widths[slot] (int32, on the device). Returns out, changed in place."""
    if table.shape[0] == 0 or longest == 0:
        return out
    tokens, k = x.shape
    n = out.shape[1]
    block_r = max(MIN_DOT, triton.next_power_of_2(a_stack.shape[1]))
    x, out_view = x.contiguous(), out
    scratch = torch.empty(tokens, block_r, device=x.device, dtype=torch.float32)
    m_tiles = triton.cdiv(longest, BLOCK_M)
    _shrink[(table.shape[0], m_tiles)](
        x, a_stack, scratch, table, widths, x.stride(0), a_stack.stride(0), a_stack.stride(1), scratch.stride(0), k,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expand[(table.shape[0], m_tiles, triton.cdiv(n, BLOCK_N))](
        scratch, bt_stack, out_view, table, widths, scratch.stride(0), bt_stack.stride(0), bt_stack.stride(1),
        out_view.stride(0), n, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
