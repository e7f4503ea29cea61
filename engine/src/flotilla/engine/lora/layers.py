"""The serving model with LoRA slots: each decoder layer's linear layers (qkv, o, gate_up, down) are
wrapped so that, after the base matmul, each segment of rows adds the update of its adapter's slot.

`LoRAWeights` owns the slot stacks (per wrapped layer, A [slots, width, in] and Bt [slots, width, out],
width = the layer's shards x --max-lora-rank) and the step's segments, which every wrapped layer reads
(the model's forward signature stays the base model's). A slot is filled by copying an adapter's packed
update into it; its width in each layer is what the adapter uses there, so a rank-8 adapter in a
rank-64 slot costs rank 8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flotilla.engine.kernels.lora import Segment, add_lora
from flotilla.engine.lora.adapter import LoRAAdapter
from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig


class StepSegments:
    """The current step's segments, shared by every wrapped layer (set by the runner before a forward);
    on CUDA also as the device table the Triton kernels read, built once per step."""

    def __init__(self) -> None:
        self.segments: Sequence[Segment] = ()
        self._table: tuple[torch.Tensor, int] | None = None

    def set(self, segments: Sequence[Segment]) -> None:
        self.segments, self._table = segments, None

    def table(self, device: torch.device) -> tuple[torch.Tensor, int]:
        if self._table is None:
            from flotilla.engine.kernels.triton_lora import segment_table

            self._table = segment_table(self.segments, device)
        return self._table


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, bt: torch.Tensor, step: StepSegments) -> None:
        super().__init__()
        self.base = base
        self.a_stack, self.bt_stack = a, bt
        self.widths = [0] * a.shape[0]  # per slot
        # The same on the device, for the Triton kernels (CUDA only).
        self.widths_tensor = torch.zeros(a.shape[0], dtype=torch.int32, device=a.device)
        self.step = step

    def set_width(self, slot: int, width: int) -> None:
        self.widths[slot] = width
        self.widths_tensor[slot] = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.step.segments:
            if x.is_cuda:
                from flotilla.engine.kernels.triton_lora import triton_add_lora

                table, longest = self.step.table(x.device)
                triton_add_lora(out, x, self.a_stack, self.bt_stack, self.widths_tensor, table, longest)
            else:
                add_lora(out, x, self.a_stack, self.bt_stack, self.widths, self.step.segments)
        return out


class LoRAWeights:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.num_slots = num_slots
        self.step = StepSegments()
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        self.slot_contents: list[str | None] = [None] * num_slots
        shapes = hf_names.serving_linear_shapes(config)
        body = model.get_submodule(hf_names.BODY)
        for i in range(config.num_hidden_layers):
            for module in hf_names.SERVING_LINEARS:
                out_f, in_f = shapes[module]
                width = len(hf_names.FUSED.get(module, (module,))) * max_rank
                parent_name, _, attr = hf_names.layer_module(i, module).rpartition(".")
                parent = body.get_submodule(parent_name)
                wrapped = LoRALinear(
                    getattr(parent, attr),
                    torch.zeros(num_slots, width, in_f, device=device, dtype=dtype),
                    torch.zeros(num_slots, width, out_f, device=device, dtype=dtype),
                    self.step,
                )
                setattr(parent, attr, wrapped)
                self.layers[(i, module)] = wrapped

    @property
    def slot_bytes(self) -> int:
        """Device memory one slot takes (every slot is sized for --max-lora-rank)."""
        return sum((w.a_stack[0].nbytes + w.bt_stack[0].nbytes) for w in self.layers.values())

    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies the adapter's updates into the slot; layers it does not adapt get width 0."""
        for key, layer in self.layers.items():
            update = adapter.updates.get(key)
            if update is None:
                layer.set_width(slot, 0)
                continue
            width = update.width
            layer.a_stack[slot, :width].copy_(update.a)
            layer.bt_stack[slot, :width].copy_(update.bt)
            layer.set_width(slot, width)
        self.slot_contents[slot] = adapter.name

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_width(slot, 0)
        self.slot_contents[slot] = None
