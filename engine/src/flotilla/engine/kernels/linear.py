"""Dense linear layers, with float32 on the CPU through oneDNN.

torch's `F.linear` sends a float32 CPU matmul to MKL's sgemm, which on this project's AMD CPUs ran the
model's layers at 60-125 GFLOP/s; oneDNN's own kernel (`mkldnn::_linear_pointwise`, the op torch.compile
emits for a CPU linear) ran the same layers 1.3-1.7x faster on 2 threads, with errors of the same size
against float64 (a few 1e-6). Everything else (other dtypes, CUDA, autograd: the op has no backward)
keeps `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The profiler's name for the oneDNN op, for `bench offline`'s step breakdown.
ONEDNN_LINEAR_OP = "mkldnn::_linear_pointwise"


def _onednn_usable() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_usable()


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear` above."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
