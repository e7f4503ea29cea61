"""The knobs of one engine process, and how many KV blocks a memory budget holds. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flotilla.contract import (
    DEFAULT_QUANTIZATION_GROUP_SIZE,
    FLAG_QUANTIZATION,
    FLAG_QUANTIZATION_GROUP_SIZE,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
)


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: the config's dtype on CUDA (bf16 if none), float32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory: int | None = None  # bytes; default: 1 GiB on CPU, a fraction of free memory on CUDA
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | triton
    seed: int = 0
    cpu_threads: int = 0  # torch CPU threads for model steps; 0: torch's default (one per core)
    show_progress: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority | fair (core/policy.py)
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair share; absent tenants weigh 1
    # Weight-only quantization of the decoder's linear layers at load time (model/quantize.py): none, int8
    # (per output channel) or int4 (per group of quantization_group_size input features).
    quantization: str = "none"
    quantization_group_size: int = DEFAULT_QUANTIZATION_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"{FLAG_QUANTIZATION} {self.quantization}: must be one of {', '.join(QUANTIZATION_METHODS)}"
            )
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(
                f"{FLAG_QUANTIZATION_GROUP_SIZE} {self.quantization_group_size}: must be one of "
                f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}"
            )
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError(
                f"scheduling_policy must be fcfs, priority or fair, got {self.scheduling_policy!r}"
            )
        for tenant, weight in self.tenant_weights.items():
            if not weight > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be positive, got {weight}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be 0 (torch's default) or more, got {self.cpu_threads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )


def blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return max(0, math.floor(budget_bytes / (bytes_per_token * block_size)))
