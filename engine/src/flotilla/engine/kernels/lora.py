"""Adds each batch row's LoRA update to a linear layer's output: the rows of a batch are grouped in
segments, each a run of consecutive rows of requests with the same adapter slot, and a segment adds
`(x @ A[slot].T) @ Bt[slot]` over its adapter's width (the sum of its ranks in this layer; A and Bt are
the slot stacks lora/layers.py keeps, the scale folded into Bt). Base-model rows belong to no segment.

On the CPU (and wherever Triton is not used) the segments run as two matmuls each, on views of the
stacks, so a batch of one adapter costs two small GEMMs per layer. On CUDA, `triton_add_lora`
(triton_lora.py) runs every segment in one launch per half.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (first row, row after the last, slot): the runner's segments for one step, in row order.
Segment = tuple[int, int, int]


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    bt_stack: torch.Tensor,
    widths: Sequence[int],
    segments: Sequence[Segment],
) -> torch.Tensor:
    """out[s:e] += (x[s:e] @ a_stack[slot, :w].T) @ bt_stack[slot, :w] for each segment (w: the slot's
    width in this layer; a slot of width 0 adds nothing). Returns out, changed in place."""
    for start, end, slot in segments:
        width = widths[slot]
        if width:
            shrunk = torch.mm(x[start:end], a_stack[slot, :width].T)
            out[start:end].addmm_(shrunk, bt_stack[slot, :width])
    return out


def reference_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    bt_stack: torch.Tensor,
    widths: Sequence[int],
    segments: Sequence[Segment],
) -> torch.Tensor:
    """Row by row, in float64: what add_lora and the Triton kernel are tested against."""
    result = out.double().clone()
    for start, end, slot in segments:
        width = widths[slot]
        for row in range(start, end):
            shrunk = x[row].double() @ a_stack[slot, :width].double().T
            result[row] += shrunk @ bt_stack[slot, :width].double()
    return result.to(out.dtype)
