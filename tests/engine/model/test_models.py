"""Model folders: the tiny presets, the chat template, and clear errors for folders that cannot load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from flotilla.engine.model.config import ModelConfig, ModelLoadError
from flotilla.engine.model.synthetic.presets import PRESETS, build_tokenizer, random_weights
from flotilla.engine.text.tokenizer import load_tokenizer


def test_preset_folder_says_it_is_random_and_loads(tiny_preset):
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.core.sampling_params import SamplingParams
    from flotilla.engine.llm_engine import LLMEngine

    config = json.loads((tiny_preset / "config.json").read_text())
    assert "RANDOM WEIGHTS" in config["_flotilla_note"]
    assert "RANDOM WEIGHTS" in (tiny_preset / "README.md").read_text()
    mc = ModelConfig.from_file(tiny_preset / "config.json")
    assert mc.architecture == "Qwen2ForCausalLM" and mc.tie_word_embeddings and mc.qkv_bias
    assert 7000 <= mc.vocab_size <= 8192 and mc.max_position_embeddings == 2048

    engine = LLMEngine(EngineConfig(model=str(tiny_preset), kv_cache_memory=1 << 24, show_progress=False))
    n_params = sum(p.numel() for p in engine.runner.model.parameters())
    assert 20e6 < n_params < 30e6
    defaults = engine.default_sampling_params()
    assert defaults.temperature == 0.8 and defaults.top_p == 0.95  # from generation_config.json
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    text = engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, seed=1), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)


def test_presets_are_deterministic():
    preset = PRESETS["tiny-llama"]
    assert build_tokenizer(preset).to_str() == build_tokenizer(preset).to_str()
    small = {**preset, "vocab_size": 50, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    a, b = random_weights(small, seed=0), random_weights(small, seed=0)
    assert all((a[k] == b[k]).all() for k in a)


def test_llama_tokenizer_adds_bos_once(tmp_path):
    tok = build_tokenizer(PRESETS["tiny-llama"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    mt = load_tokenizer(tmp_path)
    ids = mt.encode("hello world")
    assert ids[0] == mt.bos_token_id and ids[1] != mt.bos_token_id
    assert mt.decode(ids) == "hello world"


def test_model_init_refuses_a_non_empty_folder(tmp_path, capsys):
    from flotilla.cli import main

    (tmp_path / "x").write_text("keep me")
    assert main(["model", "init", "--preset", "tiny-llama", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "config.json: field 'architectures': GPT2LMHeadModel is not supported",
        ),
        ({"hidden_size": "big"}, "field 'hidden_size': expected int"),
        ({"num_key_value_heads": 3}, "field 'num_key_value_heads': 3 does not divide"),
        (
            {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 2}},
            "field 'rope_scaling': type 'yarn'",
        ),
        ({"hidden_act": "gelu"}, "field 'hidden_act'"),
    ],
)
def test_bad_config_fields_are_named(hf_models, tmp_path, change, message):
    folder, _ = hf_models("llama-gqa")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        ModelConfig.from_file(tmp_path / "config.json")


def test_missing_files_and_tensors_are_named(hf_models, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from flotilla.engine.model.loader import load_model

    folder, _ = hf_models("llama-gqa")
    broken = tmp_path / "m"
    shutil.copytree(folder, broken)
    with pytest.raises(ModelLoadError, match="config.json: file not found"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 64)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match="missing from the safetensors files: model.layers.1.mlp.gate_up_proj.weight"
    ):
        load_model(broken, torch.float32, torch.device("cpu"), 64, show_progress=False)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(broken, torch.float32, torch.device("cpu"), 64, show_progress=False)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json: file not found"):
        load_tokenizer(broken)


def test_sharded_checkpoints_load(hf_models, tmp_path):
    """A checkpoint split in shards with an index file loads to the same weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from flotilla.engine.model.loader import load_model

    folder, model = hf_models("llama-gqa")
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    ours = load_model(tmp_path, torch.float32, torch.device("cpu"), 64, show_progress=False)
    torch.testing.assert_close(ours.lm_head.weight, model.lm_head.weight)


def test_loading_a_model_and_a_step_import_no_compiler(tiny_preset):
    """Start-up is what scale-from-zero waits for: torch._dynamo alone takes about 0.9 s to import, torch.fx's
    symbolic shapes with sympy 0.3-0.5 s. Nothing the engine does on the CPU compiles or traces, so neither
    loading a model nor a step may import them (nn.Embedding's own init on the meta device imported the one,
    Module.to_empty the other)."""
    script = (
        "import sys\n"
        "from flotilla.engine.config import EngineConfig\n"
        "from flotilla.engine.core.sampling_params import SamplingParams\n"
        "from flotilla.engine.llm_engine import LLMEngine\n"
        f"engine = LLMEngine(EngineConfig(model={str(tiny_preset)!r}, device='cpu', dtype='bfloat16',"
        " kv_cache_memory=1 << 22, show_progress=False))\n"
        "engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), 'r')\n"
        "while engine.has_unfinished_requests():\n"
        "    engine.step()\n"
        "heavy = ('torch._dynamo', 'torch._inductor', 'torch.fx.experimental.symbolic_shapes', 'sympy')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
