"""The model `flotilla engine bench gpu` runs: a random-weight Llama of about 1B parameters (Llama 3.2 1B's
shape with a 32k vocabulary: hidden 2048, 16 layers, 32 query and 8 KV heads of 64, MLP 8192, tied
embeddings; 1.04B parameters, 2.08 GB in bfloat16), written once to a folder and reused, and a tiny one of
the same kind for `--quick`.

The folder is a plain Hugging Face folder (config.json, model.safetensors in bfloat16, a word-level
tokenizer with one token per id) that the engine and transformers both load. The weights are normal(0,
0.02) like transformers' initialisation, drawn on the bench's device (a 1B model drawn on the CPU takes
tens of seconds; on a GPU, well under one); they are noise, which is all a throughput figure needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig

NOTE = (
    "RANDOM WEIGHTS, written by `flotilla engine bench gpu` to measure the engine; never trained, "
    "produces meaningless text."
)

# About 1.04B parameters; the tied embedding doubles as the LM head, so every weight is read per token.
LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
# For --quick on the CPU: the same structure, about 0.3M parameters.
LLAMA_TINY: dict[str, Any] = {
    **LLAMA_1B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2


def hf_config(shape: dict[str, Any]) -> dict[str, Any]:
    """config.json for a Llama of this shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "_flotilla_note": NOTE,
    }


def tensor_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a Llama of this shape."""
    return hf_names.checkpoint_tensors(ModelConfig.from_dict(hf_config(shape)))


def parameter_count(shape: dict[str, Any]) -> int:
    total = 0
    for dims in tensor_shapes(shape).values():
        n = 1
        for d in dims:
            n *= d
        total += n
    return total


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id (`<unk>`, `<s>`, `</s>`, then t3, t4, ...), so every id
    the random model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def random_weights(shape: dict[str, Any], seed: int, device: str) -> dict[str, Any]:
    """normal(0, 0.02) matrices and unit norms, in bfloat16, drawn on `device`, returned on the CPU."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, dims in tensor_shapes(shape).items():
        if hf_names.is_norm(name):
            out[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            w = torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02
            out[name] = w.to(torch.bfloat16).cpu()
    return out


def write_random_llama(
    folder: str | Path,
    shape: dict[str, Any],
    seed: int = 0,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> tuple[Path, bool]:
    """Writes the model folder, or reuses it when its config.json is this shape's (config.json is written
    last, so a folder with it is complete). Returns the folder and whether it was reused."""
    from safetensors.torch import save_file

    folder = Path(folder)
    config = hf_config(shape)
    config_path = folder / "config.json"
    if config_path.is_file() and (folder / "model.safetensors").is_file():
        try:
            if json.loads(config_path.read_text()) == config:
                log(f"bench gpu: reusing the model in {folder}")
                return folder, True
        except json.JSONDecodeError:
            pass
    folder.mkdir(parents=True, exist_ok=True)
    config_path.unlink(missing_ok=True)
    log(f"bench gpu: writing a random Llama of {parameter_count(shape) / 1e6:,.1f}M parameters to {folder}")
    tok = word_tokenizer(shape["vocab_size"])
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "model_max_length": shape["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    gen_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen_config, indent=2, sort_keys=True) + "\n")
    tensors = random_weights(shape, seed, device)
    partial = folder / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, folder / "model.safetensors")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder, False
