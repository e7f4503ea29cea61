"""PEFT adapters written by PEFT itself over the engine tests' random Hugging Face models (hf_models in
tests/engine/conftest.py), with their reference models: the base with that adapter applied by PEFT."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

# Three adapters per base: different ranks, scalings and module sets (attention only, MLP only, all).
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp-r16-rslora": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "down_proj"], "use_rslora": True},
    "all-r4": {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}  # fmt: skip


def write_adapter(base_model, folder: Path, seed: int, **options):
    """Saves a PEFT LoRA over a copy of `base_model` with random A and B (PEFT's init_lora_weights=False),
    scaled down so that outputs change but stay well conditioned; returns the PEFT model (the reference)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(lora_dropout=0.0, init_lora_weights=False, **options)
    model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    model.eval()
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="session")
def lora_adapters(hf_models, tmp_path_factory):
    """arch -> {adapter name: (folder, PEFT reference model)}, built once per session."""
    cache: dict[str, dict[str, tuple[Path, object]]] = {}

    def get(arch: str):
        if arch not in cache:
            _folder, base = hf_models(arch)
            made = {}
            for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
                folder = tmp_path_factory.mktemp(f"{arch}-{name}")
                made[name] = (folder, write_adapter(base, folder, seed, **options))
            cache[arch] = made
        return cache[arch]

    return get
