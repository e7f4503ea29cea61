"""The knobs of one engine process (declared in flotilla.contract.ENGINE_KNOBS), and how many KV blocks a
memory budget holds. No torch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flotilla.contract import (
    ATTENTION_BACKENDS,
    ENGINE_KNOBS,
    FLAG_ENABLE_LORA,
    FLAG_LORA_MODULES,
    FLAG_MAX_CPU_LORAS,
    FLAG_MAX_LORAS,
    FLAG_MAX_NUM_SEQS,
    FLAG_NUM_SPECULATIVE_TOKENS,
    FLAG_QUANTIZATION,
    FLAG_QUANTIZATION_GROUP_SIZE,
    FLAG_SPECULATIVE_MAX_BATCH_SIZE,
    FLAG_SPECULATIVE_METHOD,
    FLAG_SPECULATIVE_MODEL,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
)

FLAG_CUDA_GRAPH_SIZES = ENGINE_KNOBS["cuda_graph_sizes"].flag


def knob_default(name: str) -> Any:
    """The field of knob `name`, with the default flotilla.contract.ENGINE_KNOBS gives it (and the knob's
    name in its metadata, which tests/test_engine_knobs.py checks is the field's)."""
    knob = ENGINE_KNOBS[name]
    if isinstance(knob.default, Mapping):
        return field(default_factory=knob.fresh_default, metadata={"knob": name})
    return field(default=knob.default, metadata={"knob": name})


@dataclass
class EngineConfig:
    # The knobs, with the types the engine reads them as; what each means, its flag and its default are
    # in flotilla.contract.ENGINE_KNOBS (tests/test_engine_knobs.py checks that they agree).
    model: str
    dtype: str = knob_default("dtype")  # auto: the config's dtype on CUDA (bf16 if none), float32 on CPU
    device: str = knob_default("device")  # auto: cuda when available, else cpu
    block_size: int = knob_default("block_size")
    max_num_seqs: int = knob_default("max_num_seqs")
    max_num_batched_tokens: int = knob_default("max_num_batched_tokens")
    max_model_len: int | None = knob_default("max_model_len")  # None: the model's max_position_embeddings
    kv_cache_memory: int | None = knob_default(
        "kv_cache_memory"
    )  # bytes; None: 1 GiB on CPU, a share on CUDA
    gpu_memory_utilization: float = knob_default("gpu_memory_utilization")
    enable_prefix_caching: bool = knob_default("enable_prefix_caching")
    attention_backend: str = knob_default("attention_backend")  # one of ATTENTION_BACKENDS
    seed: int = knob_default("seed")
    cpu_threads: int = knob_default("cpu_threads")  # torch threads for model steps; 0: torch's (one per core)
    show_progress: bool = True  # not a knob (no flag): whether loading shows progress bars
    scheduling_policy: str = knob_default("scheduling_policy")  # one of SCHEDULING_POLICIES (core/policy.py)
    tenant_weights: dict[str, float] = knob_default("tenant_weights")  # fair share; absent tenants weigh 1
    # Weight-only quantization of the decoder's linear layers at load time (model/quantize.py): none, int8
    # (per output channel) or int4 (per group of quantization_group_size input features).
    quantization: str = knob_default("quantization")
    quantization_group_size: int = knob_default("quantization_group_size")
    # Speculative decoding: none, ngram (prompt lookup) or draft (speculative_model, a smaller model folder
    # with the same tokenizer); num_speculative_tokens drafts are verified per step, in steps that run at
    # most speculative_max_batch_size requests.
    speculative_method: str = knob_default("speculative_method")
    num_speculative_tokens: int = knob_default("num_speculative_tokens")
    speculative_model: str | None = knob_default("speculative_model")
    speculative_max_batch_size: int = knob_default("speculative_max_batch_size")
    # CUDA graphs for decode steps (worker/cuda_graphs.py), on CUDA with the Triton backend unless
    # enforce_eager; the batch sizes captured (default: 1, 2, 4, 8, then every 16 up to 256).
    enforce_eager: bool = knob_default("enforce_eager")
    cuda_graph_sizes: list[int] | None = knob_default("cuda_graph_sizes")
    # LoRA adapters (lora/): served when enable_lora (lora_modules implies it), at most max_loras in one
    # batch (device slots), ranks up to max_lora_rank, at most max_cpu_loras loaded in host memory; adapters
    # named by an hf:// or http(s):// URI are fetched into lora_cache_dir (lora/source.py).
    enable_lora: bool = knob_default("enable_lora")
    lora_modules: dict[str, str] = knob_default("lora_modules")
    max_loras: int = knob_default("max_loras")
    max_lora_rank: int = knob_default("max_lora_rank")
    max_cpu_loras: int = knob_default("max_cpu_loras")
    lora_cache_dir: str | None = knob_default("lora_cache_dir")  # None: ~/.cache/flotilla/lora-adapters

    def __post_init__(self) -> None:
        self._check_speculation()
        self._check_lora()
        for size in self.cuda_graph_sizes or []:
            if not 1 <= size <= self.max_num_seqs:
                raise ValueError(
                    f"{FLAG_CUDA_GRAPH_SIZES} {size}: each size must be between 1 and {FLAG_MAX_NUM_SEQS} "
                    f"({self.max_num_seqs})"
                )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"{FLAG_QUANTIZATION} {self.quantization}: must be one of {', '.join(QUANTIZATION_METHODS)}"
            )
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(
                f"{FLAG_QUANTIZATION_GROUP_SIZE} {self.quantization_group_size}: must be one of "
                f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        for tenant, weight in self.tenant_weights.items():
            if not weight > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be positive, got {weight}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be 0 (torch's default) or more, got {self.cpu_threads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )

    def _check_speculation(self) -> None:
        method = self.speculative_method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"{FLAG_SPECULATIVE_METHOD} {method}: must be one of {', '.join(SPECULATIVE_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{FLAG_NUM_SPECULATIVE_TOKENS} {self.num_speculative_tokens}: must be between 1 and "
                f"{MAX_SPECULATIVE_TOKENS}"
            )
        if self.speculative_max_batch_size < 1:
            raise ValueError(
                f"{FLAG_SPECULATIVE_MAX_BATCH_SIZE} {self.speculative_max_batch_size}: must be 1 or more"
            )
        if method == "draft" and not self.speculative_model:
            raise ValueError(
                f"{FLAG_SPECULATIVE_METHOD} draft: needs {FLAG_SPECULATIVE_MODEL} (the draft model's folder)"
            )
        if method != "draft" and self.speculative_model:
            raise ValueError(
                f"{FLAG_SPECULATIVE_MODEL} {self.speculative_model}: only used with {FLAG_SPECULATIVE_METHOD} "
                f"draft, not {method}"
            )

    def _check_lora(self) -> None:
        if self.lora_modules:
            self.enable_lora = True
        for name, limit in (("max_loras", 1), ("max_lora_rank", 1), ("max_cpu_loras", 1)):
            if getattr(self, name) < limit:
                raise ValueError(f"{ENGINE_KNOBS[name].flag} {getattr(self, name)}: must be 1 or more")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"{FLAG_MAX_CPU_LORAS} {self.max_cpu_loras}: must be at least {FLAG_MAX_LORAS} "
                f"({self.max_loras}): an adapter in a device slot is also kept in host memory"
            )
        if self.enable_lora and self.quantization != "none":
            # Adapters would add their float update to a quantized base; without a parity test against
            # PEFT over the same quantized weights that is not promised, so it is refused.
            raise ValueError(
                f"{FLAG_QUANTIZATION} {self.quantization} with {FLAG_ENABLE_LORA}: LoRA adapters are served "
                "over an unquantized base only"
            )
        if len(self.lora_modules) > self.max_cpu_loras:
            raise ValueError(
                f"{FLAG_LORA_MODULES}: {len(self.lora_modules)} adapters, more than {FLAG_MAX_CPU_LORAS} "
                f"({self.max_cpu_loras})"
            )

    @property
    def speculates(self) -> bool:
        return self.speculative_method != "none"


def blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return max(0, math.floor(budget_bytes / (bytes_per_token * block_size)))
