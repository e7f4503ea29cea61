"""What every benchmark report starts with: the model, the device and the engine's shape, so that two
reports can be compared knowing what ran."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any


def engine_header(
    args: argparse.Namespace, engine, input_len: tuple[int, int], output_len: tuple[int, int]
) -> dict[str, Any]:
    import torch

    info = engine.model_info
    return {
        "model": str(Path(args.model).resolve()),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "input_len": list(input_len),
        "output_len": list(output_len),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_blocks": engine.runner.num_blocks,
        "quantization": info.quantization,
        "quantization_group_size": info.quantization_group_size,
        "weight_bytes": info.weight_bytes,
        "bf16_weight_bytes": info.bf16_weight_bytes,  # the same weights at 2 bytes per element
        "quantized_layer_kernels": info.kernels,
    }


def json_safe(value: Any) -> Any:
    """NaN and infinity as null: a report's JSON stays strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
