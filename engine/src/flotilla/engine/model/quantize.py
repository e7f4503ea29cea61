"""Weight-only quantization of the decoder's linear layers, at load time, from a float checkpoint.

Quantized: every decoder layer's q/k/v, o, gate/up and down projections (the engine's fused `qkv_proj`,
`o_proj`, `gate_up_proj` and `down_proj`): all of a decoder layer's weights but its norms, and most of
the bytes a decode step reads.

Left in float (the model's dtype), on purpose:
- the token embeddings: a row lookup, not a matmul, so no weight-only kernel applies; and with tied
  embeddings (Qwen2, small Llamas) the same tensor is the LM head's weight;
- the LM head: it makes the logits every sampled token comes from, so its error shows directly as other
  tokens chosen (gpt-fast and vLLM keep it in float by default too), and when tied it is the embeddings;
- the RMSNorm weights and the biases: a few numbers per layer; quantizing them saves nothing and costs
  accuracy where the activations are scaled.

Formats (the math is the small pure functions below, tested directly):
- int8: symmetric, per output channel: w ~ q * s, q in [-127, 127], one scale per row.
- int4: per group of `group_size` consecutive input features: w ~ (q - 8) * s + z, q in [0, 15];
  asymmetric (z = min + 8s, every group's 16 levels span its own range; what the engine uses) or symmetric
  (z = 0). That is torch's int4 ("tinygemm") convention, so its kernels take the scales and zeros as they
  are. Two values per byte.
- The scales (and zeros) are kept in the kernels' dtype (bfloat16; float16 for a float16 model) and count
  in the weight bytes (`weight_bytes`).

Forward (chosen per layer when it is built):
- CPU: `torch._weight_int8pack_mm` (int8), `torch._weight_int4pack_mm_for_cpu` over
  `torch._convert_weight_to_int4pack_for_cpu`'s packing (int4). Their fast paths are bfloat16/float16 ones:
  measured here (torch 2.15, one thread, a 2752x512 layer), in float32 they took 1.3-2.4 ms for one token
  and 60-80 ms for 32 tokens, against 0.14 and 1.2 ms for a float32 matmul (and 0.4 and 1.4 ms for int8
  dequantize-then-matmul); in bfloat16, 0.08-0.10 ms for one token. So a float32 model runs these layers
  in bfloat16 (the input cast down, the output cast back).
- CUDA: `torch._weight_int8pack_mm` and `torch._weight_int4pack_mm` over `torch._convert_weight_to_int4pack`'s
  packing, in bfloat16 (float16 for a float16 model).
- Otherwise dequantize-then-matmul in the input's dtype, from a portable packing: when this torch lacks the
  kernel, when the kernel refuses the shape (the CPU int4 packing wants out_features divisible by 16), or
  when its answer on a probe input built at load time differs from the dequantized reference (a wrong
  packing convention in another torch version is caught here, not in the output).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model import hf_names

log = logging.getLogger(__name__)

# The decoder's linear layers, by their names in llama.py (q/k/v and gate/up fused).
QUANTIZED_LAYERS = hf_names.SERVING_LINEARS
DEQUANTIZE = "dequantize-then-matmul"
_EPS = 1e-12  # the smallest scale: an all-zero row or group quantizes to zeros
_PROBE_ROWS = 3
_PROBE_TOLERANCE = 2e-2  # relative; the kernel and the reference differ only by bfloat16 rounding


# -- the math ---------------------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: (q int8 [N, K] in [-127, 127], scale float32 [N]); w ~ q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=_EPS)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per group of `group_size` input features: (q uint8 [N, K] in [0, 15], scales float32 [N, K/group],
    zeros float32 [N, K/group], or None when symmetric); w ~ (q - 8) * scale + zero."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide {k} input features")
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = (groups.abs().amax(dim=-1) / 7).clamp(min=_EPS)
        q = torch.round(groups / scales[..., None]).clamp(-8, 7) + 8
        zeros = None
    else:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=_EPS)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        zeros = low + 8 * scales
    return q.to(torch.uint8).reshape(n, k), scales, zeros


def dequantize_int4(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    n, k = q.shape
    groups = (q.reshape(n, k // group_size, group_size).to(dtype) - 8) * scales.to(dtype)[..., None]
    if zeros is not None:
        groups = groups + zeros.to(dtype)[..., None]
    return groups.reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> uint8 [N, K/2]: even input features in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the weight-only kernels compute in: the model's if it is half precision, else bfloat16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


# -- the layers ---------------------------------------------------------------------------------------------
# A kernel candidate: (the torch op's name, pack: () -> the weights in its layout, op: (x, packed) -> x @ W.T).
Candidate = tuple[str, Callable[[], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _torch_ops(*names: str) -> tuple[Callable[..., torch.Tensor], ...] | None:
    """torch's private ops of these names, or None when this torch lacks one of them."""
    ops = tuple(getattr(torch, name, None) for name in names)
    return None if any(op is None for op in ops) else ops  # pyright: ignore[reportReturnType]


def _first_agreeing(
    candidates: list[Candidate],
    reference: torch.Tensor,
    compute_dtype: torch.dtype,
) -> tuple[str, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None:
    """The first candidate that packs, runs and agrees with the dequantized reference weight [N, K] on a
    probe input; None when none does."""
    gen = torch.Generator(device=reference.device).manual_seed(0)  # the global RNG (sampling) stays put
    x = torch.randn(_PROBE_ROWS, reference.shape[1], generator=gen, device=reference.device)
    want = F.linear(x, reference)
    for name, pack, op in candidates:
        try:
            packed = pack()
            got = op(x.to(compute_dtype).contiguous(), packed).float()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            log.debug("%s refused a %dx%d layer: %s", name, *reference.shape, exc)
            continue
        error = float((got - want).norm() / want.norm().clamp(min=_EPS)) if got.shape == want.shape else 1.0
        if error < _PROBE_TOLERANCE:
            return name, packed, op
        log.debug("%s disagrees with the dequantized reference (relative error %.3g)", name, error)
    return None


class QuantizedLinear(nn.Module):
    """A weight-only quantized stand-in for nn.Linear: float input, float output, float bias. `qweight`
    holds the weights (in the kernel's layout when a kernel serves the layer); `kernel` names the torch
    op its forward calls, or DEQUANTIZE."""

    qweight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        self.kernel = DEQUANTIZE
        self._op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _settle(self, portable: torch.Tensor, reference: torch.Tensor, candidates: list[Candidate]) -> None:
        found = _first_agreeing(candidates, reference, self.compute_dtype)
        if found is None:
            self.register_buffer("qweight", portable)
        else:
            self.kernel, packed, self._op = found
            self.register_buffer("qweight", packed)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] (the fallback path; not available once a kernel's packing holds it)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._op is not None:
            y = self._op(rows.to(self.compute_dtype).contiguous(), self.qweight).to(x.dtype)
        else:
            y = F.linear(rows, self.dequantized(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8Linear(QuantizedLinear):
    """int8 weights [N, K] (the kernel takes them as they are) and one scale per output channel."""

    scales: torch.Tensor

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__(linear, compute_dtype)
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("scales", scale.to(compute_dtype))
        candidates: list[Candidate] = []
        ops = _torch_ops("_weight_int8pack_mm")
        if ops is not None:
            (op,) = ops
            candidates.append(("torch._weight_int8pack_mm", lambda: q, lambda x, w: op(x, w, self.scales)))
        self._settle(q, dequantize_int8(q, self.scales), candidates)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)


class Int4Linear(QuantizedLinear):
    """int4 weights, two per byte (in the kernel's packing when a kernel serves the layer, else
    pack_int4's), and per group of `group_size` input features a scale and a zero, as [K/group, N, 2] (the
    kernels' layout)."""

    scales_and_zeros: torch.Tensor

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, group_size: int) -> None:
        super().__init__(linear, compute_dtype)
        self.group_size = group_size
        q, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        assert zeros is not None
        both = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(compute_dtype)
        self.register_buffer("scales_and_zeros", both)
        reference = dequantize_int4(q, both[..., 0].T, both[..., 1].T, group_size)
        self._settle(pack_int4(q), reference, self._candidates(q))

    def _candidates(self, q: torch.Tensor) -> list[Candidate]:
        g, k = self.group_size, self.in_features
        # The packings' inner K tiles: 16 input features each, 8, 4 or 2 of them per tile.
        tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), 2)
        if q.device.type == "cpu":
            ops = _torch_ops("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
            if ops is None:
                return []
            pack, op = ops
            # The CPU packing takes int32 [N, K] values in [0, 15].
            return [
                (
                    "torch._weight_int4pack_mm_for_cpu",
                    lambda: pack(q.to(torch.int32), tiles),
                    lambda x, w: op(x, w, g, self.scales_and_zeros),
                )
            ]
        ops = _torch_ops("_convert_weight_to_int4pack", "_weight_int4pack_mm")
        if ops is None:
            return []
        pack, op = ops
        # The CUDA packing takes uint8 [N, K/2]; torch >= 2.5 wants the even input features in the high
        # nibble. The other order is a second candidate: the probe keeps whichever computes the layer.
        high_first = (q[:, 0::2] << 4 | q[:, 1::2]).contiguous()
        return [
            (
                "torch._weight_int4pack_mm",
                lambda packing=packing: pack(packing, tiles),
                lambda x, w: op(x, w, g, self.scales_and_zeros),
            )
            for packing in (high_first, pack_int4(q).contiguous())
        ]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self._op is not None:
            raise RuntimeError(
                f"{self.kernel}'s packing holds this layer's weights; they dequantize only in it"
            )
        scales, zeros = self.scales_and_zeros[..., 0].T, self.scales_and_zeros[..., 1].T
        return dequantize_int4(unpack_int4(self.qweight), scales, zeros, self.group_size, dtype)


# -- the model ------------------------------------------------------------------------------------------------
def quantize_model(model: nn.Module, method: str, group_size: int, device: torch.device) -> None:
    """Replaces every decoder layer's linear layers (QUANTIZED_LAYERS) of a loaded float LlamaForCausalLM
    with quantized ones built on `device`, one layer at a time: each float weight moves to the device,
    is quantized and packed there, and is freed, so the device never holds more than one float layer.
    Embeddings, norms and the LM head are left as they are (the module docstring says why)."""
    if method == "none":
        return
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r}")
    layers = cast(nn.ModuleList, model.model.layers)  # pyright: ignore[reportAttributeAccessIssue]
    for i, layer in enumerate(layers):
        for path in QUANTIZED_LAYERS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            linear: nn.Linear = getattr(owner, attr)
            compute = kernel_dtype(linear.weight.dtype)
            linear.to(device)
            if method == "int4" and linear.in_features % group_size:
                raise ValueError(
                    f"group size {group_size} does not divide {hf_names.layer_module(i, path)}'s "
                    f"{linear.in_features} input features"
                )
            quantized: QuantizedLinear = (
                Int8Linear(linear, compute) if method == "int8" else Int4Linear(linear, compute, group_size)
            )
            setattr(owner, attr, quantized)


def kernels_in_use(model: nn.Module) -> dict[str, int]:
    """What computes the model's quantized layers (a torch op's name, or DEQUANTIZE) -> how many layers."""
    return dict(Counter(m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)))


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights: every parameter and persistent buffer once (tied weights once),
    quantized weights with their scales and zeros included; derived tables (RoPE's cos/sin) excluded."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def bf16_weight_bytes(model: nn.Module, quantized_only: bool = False) -> int:
    """What the same weights take in bfloat16: 2 bytes per weight element, a quantized layer counting its
    out x in weight. quantized_only: the quantized layers' weights alone (no biases)."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    elements = sum(m.in_features * m.out_features for m in quantized)
    if not quantized_only:
        elements += sum(0 if m.bias is None else m.bias.numel() for m in quantized)
        elements += sum(p.numel() for p in model.parameters())  # deduplicated: tied weights count once
    return 2 * elements


def quantized_weight_bytes(model: nn.Module) -> int:
    """The bytes of the quantized layers' weights with their scales and zeros (biases, in float, apart)."""
    return sum(
        tensor.numel() * tensor.element_size()
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
        for name, tensor in m.named_buffers()
        if name != "bias"
    )
