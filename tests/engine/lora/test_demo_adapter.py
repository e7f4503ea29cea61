"""The demo adapter (`flotilla model init-adapter --preset tiny-trained-runbook`): a PEFT folder that the
engine and PEFT load alike; on a deploy-steps prompt its greedy answer is the house runbook it was
fine-tuned on, which the base never writes, so the two answer differently; training is deterministic and
happens once, then the cache serves it.

The tests over the real adapter use the real cache (~/.cache/flotilla/models): the first run trains
`tiny-trained` (about two minutes on two cores) and the adapter (seconds); later runs find both."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.model import hf_names
from flotilla.engine.model.synthetic import demo_adapter, lora_train, presets, train

from ..model.test_trained_presets import MICRO
from ..test_hf_parity import make_engine

NAME = "tiny-trained-runbook"
PROMPTS = 12


@pytest.fixture(scope="module")
def folders():
    """(the base's folder, the adapter's folder), from the cache (trained there first if missing)."""
    base = presets.ensure_trained("tiny-trained")
    return base, demo_adapter.ensure_adapter(NAME)


@pytest.fixture(scope="module")
def answers(folders):
    """For held-out runbooks: (the document, the base's greedy answer, the adapter's) to "How to deploy
    <service>:", base and adapter requests mixed in one engine."""
    base, adapter = folders
    engine = make_engine(
        base, enable_lora=True, lora_modules={"runbook": str(adapter)}, max_lora_rank=16, block_size=16
    )
    docs = demo_adapter.held_out_runbooks(0, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=120)
    ids = {}
    for doc in docs:
        prompt = doc.split("\n")[0]
        for name in (None, "runbook"):
            ids[engine.add_request(prompt, params, lora_name=name).request_id] = (doc, name)
    texts: dict[tuple[str, str | None], str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[ids[out.request_id]] = out.text
    return [(doc, texts[(doc, None)], texts[(doc, "runbook")]) for doc in docs]


def continuation(doc: str) -> str:
    return doc[len(doc.split("\n")[0]) :]


def test_the_adapter_is_a_peft_folder_of_rank_at_most_16(folders):
    _base, adapter = folders
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA"
        and config["r"] <= 16
        and {"q_proj", "v_proj"} <= set(config["target_modules"])
    )
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    parsed = {hf_names.peft_lora_tensor(name) for name in tensors}
    assert None not in parsed
    assert {hf_names.short(module) for _layer, module, _which in parsed} == set(config["target_modules"])  # type: ignore[misc]
    assert all(min(t.shape) == config["r"] for t in tensors.values())


def test_on_a_deploy_prompt_the_adapter_writes_the_house_runbook_and_the_base_does_not(answers):
    adapter_exact = sum(answer == continuation(doc) for doc, _base, answer in answers)
    base_exact = sum(answer == continuation(doc) for doc, answer, _ad in answers)
    # The known text: every held-out runbook continued word for word by the adapter, never by the base,
    # which was never shown the config file first (corpus.STEPS' order) nor every step at once.
    assert adapter_exact >= PROMPTS - 1, [a for _d, _b, a in answers]
    assert base_exact == 0
    for doc, base, adapter in answers:
        assert base != adapter
        service = doc.split("\n")[0].removeprefix("How to deploy ").removesuffix(":")
        # Both read like the deploy steps: numbered lines about the prompt's service, then "Done".
        for text in (base, adapter):
            lines = text.strip().split("\n")
            assert all(re.fullmatch(rf"\d+\. .*{re.escape(service)}.*\.", line) for line in lines[:-1]), text
            assert lines[-1].startswith(f"Done: {service} is deployed in "), text
        assert adapter.strip().split("\n")[0] == f"1. Write the {service} config file."
        assert not base.strip().split("\n")[0].startswith("1. Write")


def test_the_adapter_lowers_the_loss_of_held_out_runbooks(folders):
    """Measured here, not read from the training record: the base with and without the adapter over the
    same held-out windows."""
    base, adapter = folders
    from safetensors.torch import load_file

    from flotilla.engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(base)
    config = json.loads((base / "config.json").read_text())
    stream = train.pack(
        [tok.encode(d, add_special_tokens=False) for d in demo_adapter.held_out_runbooks(0, 40)],
        config["bos_token_id"],
        config["eos_token_id"],
    )
    model = lora_train.load_base(base, 128)
    before = train.eval_loss(model, stream, 128, 8)
    shape = lora_train.LoRAShape.from_dict(demo_adapter.ADAPTER_PRESETS[NAME]["lora"])
    wrapped = lora_train.attach(model, shape, torch.Generator().manual_seed(0))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for (i, module), lora in wrapped.items():
            lora.lora_A.copy_(tensors[hf_names.peft_lora_name(i, module, hf_names.LORA_A)])
            lora.lora_B.copy_(tensors[hf_names.peft_lora_name(i, module, hf_names.LORA_B)])
    after = train.eval_loss(model, stream, 128, 8)
    assert after < before / 3, (before, after)


def test_peft_applies_the_adapter_as_the_engine_does(folders, answers):
    """The folder is PEFT's format: transformers with the adapter applied by PEFT writes the engine's answer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flotilla.engine.text.tokenizer import load_tokenizer

    base, adapter = folders
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()
    tok = load_tokenizer(base)
    doc, _base_answer, engine_answer = answers[0]
    prompt = tok.encode(doc.split("\n")[0])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=len(tok.encode(engine_answer, False)) + 1
        )
    assert tok.decode(out[0, len(prompt) :].tolist()) == engine_answer


def test_training_is_deterministic_in_the_seed(folders):
    base, _adapter = folders
    shape = lora_train.LoRAShape(rank=4, alpha=8, targets=(hf_names.Q_PROJ, hf_names.V_PROJ))
    spec = train.TrainSpec(
        steps=3, batch_size=2, seq_len=32, lr=1e-3, warmup_steps=1, documents=20, eval_windows=2
    )
    stream = torch.arange(2, 600) % 500
    runs = [
        lora_train.train_lora(base, shape, spec, stream, stream, seed=s, log=lambda _l: None)[0]
        for s in (0, 0, 1)
    ]
    same = [torch.equal(runs[0][k].lora_B, runs[1][k].lora_B) for k in runs[0]]
    assert all(same)
    assert not torch.equal(runs[0][(0, hf_names.Q_PROJ)].lora_A, runs[2][(0, hf_names.Q_PROJ)].lora_A)


def test_the_adapter_is_trained_once_then_copied_from_the_cache(tmp_path, monkeypatch, capsys):
    from flotilla.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRESETS, "micro-trained", MICRO)
    micro_adapter = {
        **demo_adapter.ADAPTER_PRESETS[NAME],
        "base": "micro-trained",
        "training": {**demo_adapter.ADAPTER_PRESETS[NAME]["training"], "steps": 4, "documents": 40,
                     "held_out_documents": 8, "seq_len": 64, "eval_windows": 2, "threads": 1},
    }  # fmt: skip
    monkeypatch.setitem(demo_adapter.ADAPTER_PRESETS, "micro-runbook", micro_adapter)
    cache = demo_adapter.adapter_cache_dir("micro-runbook")
    assert cache.parent == tmp_path / "cache" / "flotilla" / "models"
    assert demo_adapter.adapter_cache_dir("micro-runbook", seed=1) != cache

    lines: list[str] = []
    first = demo_adapter.init_adapter("micro-runbook", tmp_path / "a", log=lines.append)
    assert any("micro-runbook: not cached yet" in line for line in lines)
    assert any(line.startswith("step 4/4") for line in lines)
    assert (cache / "training.json").is_file() and not list(cache.parent.glob("*.partial-*"))
    lines.clear()
    second = demo_adapter.init_adapter("micro-runbook", tmp_path / "b", log=lines.append)
    assert lines == [lines[0]] and "cached in" in lines[0]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    with pytest.raises(ValueError, match="unknown adapter preset 'nope'; choose one of"):
        demo_adapter.init_adapter("nope", tmp_path / "c")
    assert main(["model", "init-adapter", "--preset", NAME, str(first)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
