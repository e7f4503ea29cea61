"""Loads a Hugging Face model folder (config.json + safetensors) into our LlamaForCausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig, ModelLoadError, check_quantization
from flotilla.engine.model.llama import LlamaForCausalLM
from flotilla.engine.model.quantize import quantize_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32  # CPUs are slow at half precision matmuls
        # On a GPU: the checkpoint's half-precision dtype, else bfloat16.
        return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: field 'weight_map': missing or not an object ({exc})") from exc
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: field 'weight_map' names {f.name}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (and no model.safetensors.index.json)")
    return files


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """A model built on the meta device, given uninitialized storage on `device`, its floating-point
    parameters and buffers in `dtype` (what `model.to_empty(device=device).to(dtype)` does). Through
    torch.empty, not to_empty: to_empty's empty_like on a meta tensor runs torch's reference implementation,
    which imports torch.fx's symbolic shapes and sympy (0.3-0.5 s of start-up)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                kind = dtype if param.is_floating_point() else param.dtype
                empty = torch.empty(param.shape, dtype=kind, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = torch.empty(buffer.shape, dtype=kind, device=device)


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = True,
    quantization: str = "none",
    group_size: int = 128,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """The model, its decoder's linear layers quantized when `quantization` is int8 or int4
    (model/quantize.py). A quantized model's float weights are read into CPU memory first and reach the
    device one quantized layer at a time, so the device never holds the whole float model. `config` is
    the folder's config.json when the caller has read it already (the engine has)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder not found")
    if config is None:
        config = ModelConfig.from_file(folder / "config.json")
    check_quantization(config, quantization, group_size)
    files = weight_files(folder)
    staging = device if quantization == "none" else torch.device("cpu")

    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    materialize(model, staging, dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build(staging)
    params = dict(model.named_parameters())
    expected = set(params)
    if config.tie_word_embeddings:
        expected.discard(hf_names.weight(hf_names.LM_HEAD))
    loaded: set[str] = set()
    shards_seen: dict[str, set[int]] = {}

    total = 0
    for f in files:
        with safe_open(f, framework="pt") as handle:
            total += len(list(handle.keys()))
    progress = tqdm(total=total, desc=f"loading {folder.name}", unit="tensor", disable=not show_progress)
    with torch.no_grad():
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    progress.update(1)
                    if name.endswith(hf_names.IGNORED_SUFFIXES):
                        continue
                    if name == hf_names.weight(hf_names.LM_HEAD) and config.tie_word_embeddings:
                        continue
                    tensor = handle.get_tensor(name)
                    _load_one(f, name, tensor, params, config, loaded, shards_seen)
    progress.close()

    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(
            f"{folder}: weights missing from the safetensors files: {', '.join(missing[:8])}"
        )
    quantize_model(model, quantization, group_size, device)
    if staging != device:
        model.to(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float layers' blocks: free memory for the KV cache's sizing
        if config.tie_word_embeddings:  # moving across devices makes new parameters: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model


def _load_one(file, name, tensor, params, config, loaded, shards_seen) -> None:
    target, fused, shard = hf_names.serving_parameter(name)
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"{file}: tensor {name!r} does not belong to a {config.architecture}")
    if fused is None or shard is None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.copy_(tensor)
        loaded.add(target)
        return
    sizes = hf_names.shard_rows(config, fused)
    offset = sum(sizes[:shard])
    piece = param.narrow(0, offset, sizes[shard])
    if tuple(piece.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(piece.shape)}"
        )
    piece.copy_(tensor)
    seen = shards_seen.setdefault(target, set())
    seen.add(shard)
    if len(seen) == len(sizes):
        loaded.add(target)
