"""Fixtures for engine tests: random tiny Hugging Face models saved to a temp folder, with a byte-level
tokenizer, so our loader reads exactly what transformers wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Wider than transformers' default 0.02, so logits are peaked and greedy choices are not near-ties.
    "initializer_range": 0.2,
}

ARCHS = {
    "llama-gqa": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-mqa-tied-headdim": ("LlamaForCausalLM", {"num_key_value_heads": 1, "head_dim": 32, "tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
}  # fmt: skip


def write_byte_tokenizer(folder: Path) -> int:
    """A byte-level BPE with no merges: 256 byte tokens plus <s> and </s>. Returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def build_hf_model(folder: Path, arch_key: str, seed: int = 0):
    import torch
    import transformers

    arch, overrides = ARCHS[arch_key]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(folder)
    kind = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2", "MistralForCausalLM": "Mistral"}[arch]
    config_cls = getattr(transformers, f"{kind}Config")
    model_cls = getattr(transformers, arch)
    # eos None: transformers never stops early; the engine runs with ignore_eos to match.
    config = config_cls(**{**BASE, **overrides, "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": None})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """arch key -> (folder, transformers model), built once per session."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(arch_key: str):
        if arch_key not in cache:
            folder = tmp_path_factory.mktemp(arch_key)
            cache[arch_key] = (folder, build_hf_model(folder, arch_key))
        return cache[arch_key]

    return get


@pytest.fixture(scope="session")
def tiny_engine(hf_models):
    """An LLMEngine on the random tiny Qwen2 model (byte-level tokenizer), shared by output tests."""
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine

    folder, _ = hf_models("qwen2-bias-tied")
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            block_size=4,
            kv_cache_memory=1 << 20,
            show_progress=False,
        )
    )


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory):
    """`flotilla model init --preset tiny-qwen2`, run once through the CLI."""
    from flotilla.cli import main

    folder = tmp_path_factory.mktemp("preset") / "tiny-qwen2"
    assert main(["model", "init", "--preset", "tiny-qwen2", str(folder)]) == 0
    return folder


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    """A ModelTokenizer over write_byte_tokenizer's byte-level BPE (one token per byte; no model)."""
    from flotilla.engine.text.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    return load_tokenizer(folder)
