"""The trained presets: the synthetic corpus is deterministic and has the structure promised, the trainer
lowers the loss, its folder loads in the engine and in transformers with the same greedy tokens, and a
trained preset is trained once and then taken from the cache. Training here is a micro model for a few
steps; the real presets' three-minute runs are measured by hand (docs/models.md)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flotilla.engine.model.synthetic import corpus, presets, train
from flotilla.engine.model.synthetic.presets import PRESETS, TRAINED_PRESETS, build_tokenizer

from ..test_hf_parity import check_against_hf, make_engine

MICRO = {
    **PRESETS["tiny-trained"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "training": {
        "steps": 40,
        "batch_size": 4,
        "seq_len": 64,
        "lr": 1e-2,
        "warmup_steps": 4,
        "documents": 200,
        "held_out_documents": 40,
        "eval_windows": 8,
        "log_every": 10,
        "threads": 1,
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(PRESETS["tiny-trained"])


@pytest.fixture(scope="module")
def micro_run(tokenizer):
    """The micro preset trained for 40 steps: (config, spec, model, result, log lines)."""
    config = presets.hf_config(MICRO, tokenizer, torch_dtype="float32", note="micro")
    spec = train.TrainSpec.from_dict(MICRO["training"])
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    streams = [
        train.pack([e.ids for e in tokenizer.encode_batch(docs, add_special_tokens=False)], bos, eos)
        for docs in (corpus.training_documents(0, 200), corpus.held_out_documents(0, 40))
    ]
    lines: list[str] = []
    model, result = train.train(config, spec, streams[0], streams[1], seed=0, log=lines.append)
    return config, spec, model, result, lines


def test_corpus_is_deterministic_and_held_out_text_is_new():
    assert corpus.documents(3, 40) == corpus.documents(3, 40)
    assert corpus.documents(3, 40) != corpus.documents(4, 40)
    train_docs, held = corpus.training_documents(0, 200), corpus.held_out_documents(0, 50)
    assert not set(train_docs) & set(held)
    for doc, prompt in zip(held, corpus.sample_prompts(0, 50), strict=True):
        assert doc.startswith(prompt) and len(prompt) < len(doc) and not prompt.endswith("\n")


def test_later_lines_repeat_names_from_earlier_in_the_document():
    docs = corpus.documents(0, 100)
    kinds = dict.fromkeys(corpus.KINDS, 0)
    for doc in docs:
        if doc.startswith("def "):
            kinds["code"] += 1
            name = re.match(r"def (\w+)\(", doc).group(1)  # type: ignore[union-attr]
            assert re.search(rf"\n\w+ = {name}\(", doc), doc  # the call site repeats the function's name
            params = re.match(r"def \w+\((\w+), (\w+)\)", doc).groups()  # type: ignore[union-attr]
            body = doc.split("\n", 1)[1]
            assert all(p in body for p in params)
        elif doc.startswith("class "):
            kinds["code"] += 1
            fields = re.search(r"__init__\(self, ([^)]*)\)", doc).group(1).split(", ")  # type: ignore[union-attr]
            assert all(f"return self.{f}" in doc for f in fields)
        elif doc.startswith("How to deploy "):
            kinds["steps"] += 1
            service = doc.split("\n")[0].removeprefix("How to deploy ").removesuffix(":")
            numbered = [line for line in doc.split("\n") if re.match(r"\d+\. ", line)]
            assert [int(line.split(".")[0]) for line in numbered] == list(range(1, len(numbered) + 1))
            assert len(numbered) >= 3 and all(service in line for line in numbered)
        elif doc.startswith("Packing list for "):
            kinds["lists"] += 1
            owner = doc.removeprefix("Packing list for ").split("'")[0]
            assert doc.split("\n")[-1].startswith(f"{owner} packs ")
        elif doc.startswith("name: "):
            kinds["records"] += 1
            recalled = re.search(r"\nThe (\w+) is (\w+) and has size (\d+)\.$", doc).groups()  # type: ignore[union-attr]
            assert "name: {}, color: {}, size: {}".format(*recalled) in doc
        else:
            kinds["stories"] += 1
            person = doc.split(" ")[0]
            assert doc.count(person) >= 3 and " lives in " in doc
    assert all(n >= 15 for n in kinds.values()), kinds


def test_the_trained_presets_share_one_tokenizer_and_the_draft_is_smaller(tokenizer):
    assert TRAINED_PRESETS == ("tiny-trained", "tiny-trained-draft")
    target, draft = (PRESETS[name] for name in TRAINED_PRESETS)
    assert build_tokenizer(draft).to_str() == tokenizer.to_str()
    assert tokenizer.get_vocab_size() <= 2048
    doc = corpus.held_out_documents(0, 1)[0]
    assert tokenizer.decode(tokenizer.encode(doc).ids) == doc

    def non_embedding(p):
        h, i = p["hidden_size"], p["intermediate_size"]
        kv = p["num_key_value_heads"] * h // p["num_attention_heads"]
        return p["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * i)

    assert non_embedding(draft) * 3 <= non_embedding(target)  # a third of the matmul work per token
    for preset in (target, draft):
        train.TrainSpec.from_dict(preset["training"])  # every key is a TrainSpec field


def test_a_few_steps_lower_the_loss(micro_run):
    _, spec, _, result, lines = micro_run
    assert result.steps == spec.steps == len(result.step_losses)
    first, last = result.step_losses[:5], result.step_losses[-5:]
    assert sum(last) / 5 < sum(first) / 5
    assert result.held_out_loss < result.initial_held_out_loss
    assert result.train_loss < result.initial_held_out_loss
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == spec.steps // spec.log_every
    assert re.fullmatch(r"step 40/40  loss \d+\.\d{3}  lr \S+  \d+s", progress[-1])
    assert "held-out loss" in lines[-1]


def test_the_saved_folder_is_a_hugging_face_llama_the_engine_serves_identically(
    micro_run, tokenizer, tmp_path
):
    import transformers
    from safetensors.torch import load_file

    config, _, model, _, _ = micro_run
    folder = tmp_path / "micro"
    folder.mkdir()
    train.save_weights(model, folder)
    presets.write_folder_files(MICRO, tokenizer, config, folder)
    names = set(load_file(folder / "model.safetensors"))
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" not in names  # tied

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos to match
    ids = torch.tensor([tokenizer.encode(corpus.sample_prompts(0, 1)[0]).ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)  # what was trained

    engine = make_engine(folder)
    batch = [engine.tokenizer.encode(p) for p in corpus.sample_prompts(0, 3)]
    assert all(p[0] == config["bos_token_id"] for p in batch)
    check_against_hf(engine, hf, batch)


def test_a_trained_preset_is_trained_once_then_copied_from_the_cache(tmp_path, monkeypatch, capsys):
    from flotilla.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(PRESETS, "micro-trained", MICRO)
    cache = presets.trained_cache_dir("micro-trained")
    assert cache.parent == tmp_path / "cache" / "flotilla" / "models"
    assert presets.trained_cache_dir("micro-trained", seed=1) != cache

    lines: list[str] = []
    first = presets.init_model("micro-trained", tmp_path / "a", log=lines.append)
    assert "not cached yet" in lines[0] and any(line.startswith("step 40/40") for line in lines)
    record = json.loads((first / "training.json").read_text())
    assert record["steps"] == 40 and record["held_out_loss"] < record["initial_held_out_loss"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in first.iterdir()
    }
    assert "TRAINED" in json.loads((first / "config.json").read_text())["_flotilla_note"]
    assert not list(cache.parent.glob("*.partial-*"))

    def no_training(*args, **kwargs):
        raise AssertionError("the cached preset was trained again")

    monkeypatch.setattr(presets, "train_preset", no_training)
    assert main(["model", "init", "--preset", "micro-trained", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"micro-trained: cached in {cache}" in out and "wrote micro-trained (trained)" in out
    for path in first.iterdir():
        assert (tmp_path / "b" / path.name).read_bytes() == path.read_bytes()

    # Another definition is another cache entry.
    monkeypatch.setitem(PRESETS, "micro-trained", {**MICRO, "hidden_size": 64})
    assert presets.trained_cache_dir("micro-trained") != cache
