"""Dense linear layers, with float32 and bfloat16 on the CPU through oneDNN.

torch's `F.linear` sends a float32 CPU matmul to MKL's sgemm, which on this project's AMD CPUs ran the
model's layers at 60-125 GFLOP/s; oneDNN's own kernel (`mkldnn::_linear_pointwise`, the op torch.compile
emits for a CPU linear) ran the same layers 1.3-1.7x faster on 2 threads, with errors of the same size
against float64 (a few 1e-6). bfloat16 goes the same way on CPUs oneDNN runs bfloat16 on (AVX512-BF16,
AMX): packed, tiny-llama's layers ran 1.6-2x faster than `F.linear` in bfloat16 and 4-5x faster than
float32 on this project's Sapphire Rapids cores (AMX), with the same results as `F.linear` (both add in
float32 and round once). Everything else (float16, CUDA, autograd: the op has no backward) keeps
`F.linear`.

`pack_for_cpu` goes one step further for a model that only serves: each weight is replaced, in place, by
oneDNN's blocked layout, which it would otherwise rebuild on every call. Packed for 64 tokens, the model's
layers ran at 1.6x the plain weight's rate at 16 tokens, 1.15x at 64 and 1.1x at 256 (2 threads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The profiler's name for the oneDNN op, for `bench offline`'s step breakdown.
ONEDNN_LINEAR_OP = "mkldnn::_linear_pointwise"


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's linear runs here: none without oneDNN, bfloat16 only where the CPU has it."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


ONEDNN_DTYPES = _onednn_dtypes()
_ONEDNN = bool(ONEDNN_DTYPES)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in ONEDNN_DTYPES
        and weight.dtype == x.dtype
        and not torch.is_grad_enabled()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's op for a weight `pack_for_cpu` packed (only it reads that layout) or where `uses_onednn`;
    F.linear otherwise."""
    if weight.is_mkldnn or uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear` above."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


# The batch size the packed layout is chosen for; it serves every batch size.
PACK_BATCH_TOKENS = 64


def pack_for_cpu(model: nn.Module) -> int:
    """Packs every float32 or bfloat16 (`ONEDNN_DTYPES`) CPU `Linear` weight of a serving model for oneDNN, in place (the plain copy is
    freed, so memory does not grow); returns how many. A weight another module shares (an LM head tied to
    the embedding) stays plain. Afterwards the model runs inference only, and its state dict holds oneDNN
    tensors: take weight sizes before."""
    if not _ONEDNN:
        return 0
    shared = {
        id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)
    }
    packed = 0
    for module in model.modules():
        weight = module.weight if isinstance(module, Linear) else None
        if weight is None or weight.is_mkldnn or id(weight) in shared:
            continue
        if weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES:
            layout = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_TOKENS)
            module.weight = nn.Parameter(layout, requires_grad=False)
            packed += 1
    return packed
