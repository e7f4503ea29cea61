"""The demo LoRA adapter: `flotilla model init-adapter --preset tiny-trained-runbook DIR`.

`tiny-trained` learned, among its five kinds of document (corpus.py), the deploy steps: "How to deploy
<service>:", then three to six of eight steps in their usual order (build, test, push, config, start, logs,
dashboard, tell the team), then "Done: <service> is deployed in <n> steps.". The adapter is fine-tuned on
that one kind of document as a team's house runbook: every step, always, and the config file written
first. So on a deploy-steps prompt the base and the adapter answer differently, visibly from the first
line, and the adapter's answer is the runbook's (tests/engine/lora/test_demo_adapter.py measures both).

Trained once, in seconds, over the cached `tiny-trained` (trained first if it is not cached), then cached
beside the presets under `~/.cache/flotilla/models/<preset>-<hash>` (`$XDG_CACHE_HOME` honoured), keyed by
the adapter's definition, the base's cache folder (its own key), the trainer's version and the seed.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.engine.model import hf_names
from flotilla.engine.model.synthetic import corpus, presets

# The house order of corpus.STEPS: the config file first, then the usual order.
HOUSE_ORDER = (3, 0, 1, 2, 4, 5, 6, 7)
SERVICE_SUFFIXES = ("", "-api", "-db", "-worker")
# Held-out runbooks come from another random stream.
HELD_OUT_OFFSET = 7_000_003

ADAPTER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-trained-runbook": {
        "base": "tiny-trained",
        "documents": "runbook",
        "lora": {
            "rank": 8,
            "alpha": 16,
            "targets": [
                hf_names.Q_PROJ,
                hf_names.K_PROJ,
                hf_names.V_PROJ,
                hf_names.O_PROJ,
                hf_names.GATE_PROJ,
                hf_names.UP_PROJ,
                hf_names.DOWN_PROJ,
            ],
        },
        "training": {
            "steps": 100,
            "batch_size": 8,
            "seq_len": 128,
            "lr": 3e-3,
            "warmup_steps": 10,
            "documents": 2000,
            "held_out_documents": 100,
            "weight_decay": 0.0,
            "eval_windows": 16,
            "log_every": 25,
        },
    },
}
# Bumped whenever lora_train.py would give other weights for the same definition (cache keys include it).
ADAPTER_TRAINER_VERSION = 1
ADAPTER_NOTE = (
    "A LoRA adapter of tiny-trained, fine-tuned by `flotilla model init-adapter` on one kind of document, "
    "the deploy steps, in a house style: every step, the config file first."
)


def runbook_service(rng: random.Random) -> str:
    return corpus.made_up_word(rng) + rng.choice(SERVICE_SUFFIXES)


def runbook_for(service: str) -> str:
    """The house runbook of `service`: one document, every step in the house order."""
    lines = [f"How to deploy {service}:"]
    lines += [f"{i}. {corpus.STEPS[k].format(s=service)}" for i, k in enumerate(HOUSE_ORDER, start=1)]
    lines.append(f"Done: {service} is deployed in {len(HOUSE_ORDER)} steps.")
    return "\n".join(lines)


def runbooks(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [runbook_for(runbook_service(rng)) for _ in range(count)]


def held_out_runbooks(seed: int = 0, count: int = 100) -> list[str]:
    return runbooks(seed + HELD_OUT_OFFSET, count)


def adapter_cache_dir(name: str, seed: int = 0) -> Path:
    preset = ADAPTER_PRESETS[name]
    key = {
        "adapter": preset,
        "base_cache": presets.trained_cache_dir(preset["base"]).name,
        "trainer_version": ADAPTER_TRAINER_VERSION,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return presets.cache_root() / f"{name}-{digest}"


def init_adapter(
    name: str, folder: str | Path, seed: int = 0, log: Callable[[str], None] = presets._print
) -> Path:
    """Copies the cached adapter into `folder`, training it (and its base) first if it is not cached."""
    if name not in ADAPTER_PRESETS:
        raise ValueError(f"unknown adapter preset {name!r}; choose one of {', '.join(ADAPTER_PRESETS)}")
    folder = Path(folder)
    cache = ensure_adapter(name, seed=seed, log=log)
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(cache.iterdir()):
        shutil.copy2(path, folder / path.name)
    return folder


def ensure_adapter(name: str, seed: int = 0, log: Callable[[str], None] = presets._print) -> Path:
    """The adapter's cache folder, trained there first (once) if it is not cached."""
    cache = adapter_cache_dir(name, seed)
    record_path = cache / presets.TRAINING_RECORD
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        log(
            f"{name}: cached in {cache} (trained in {record['seconds']:.0f}s: held-out loss "
            f"{record['held_out_loss']:.3f}, the base's {record['base_held_out_loss']:.3f})"
        )
        return cache
    base = presets.ensure_trained(ADAPTER_PRESETS[name]["base"], log=log)
    log(f"{name}: not cached yet; training it once over {base}, into {cache}")
    return presets.build_once(cache, lambda partial: train_adapter(name, base, partial, seed=seed, log=log))


def train_adapter(
    name: str, base: Path, folder: Path, seed: int = 0, log: Callable[[str], None] = presets._print
) -> dict:
    """Trains the adapter over the preset folder `base` into `folder` (a PEFT folder plus training.json)."""
    from tokenizers import Tokenizer

    from flotilla.engine.model.synthetic import lora_train, train

    started = time.perf_counter()
    preset = ADAPTER_PRESETS[name]
    spec = train.TrainSpec.from_dict(preset["training"])
    shape = lora_train.LoRAShape.from_dict(preset["lora"])
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))  # the model layer reads it as the presets do
    config = json.loads((base / "config.json").read_text())
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    streams = [
        train.pack([e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], bos, eos)
        for texts in (runbooks(seed, spec.documents), held_out_runbooks(seed, spec.held_out_documents))
    ]
    wrapped, result = lora_train.train_lora(base, shape, spec, streams[0], streams[1], seed=seed, log=log)
    n_params = lora_train.save_adapter(wrapped, shape, folder, preset["base"])
    record = {
        "adapter": name,
        "base": preset["base"],
        "base_cache": base.name,
        "parameters": n_params,
        "documents": spec.documents,
        "corpus_tokens": len(streams[0]),
        "trainer_version": ADAPTER_TRAINER_VERSION,
        "seed": seed,
        "steps": result.steps,
        "threads": spec.threads,
        "seconds": result.seconds,
        "total_seconds": round(time.perf_counter() - started, 1),
        "base_held_out_loss": result.base_held_out_loss,
        "held_out_loss": result.held_out_loss,
        "train_loss": result.train_loss,
    }
    (folder / "README.md").write_text(
        f"# {name}\n\n{ADAPTER_NOTE}\n\n- base: {preset['base']}\n- rank {shape.rank}, lora_alpha "
        f"{shape.alpha:g}, on {', '.join(hf_names.short(t) for t in shape.targets)}: {n_params:,} parameters\n"
        f"- held-out loss (nats per token) on house runbooks: {result.held_out_loss:.3f}, the base's "
        f"{result.base_held_out_loss:.3f}\n\nAn example of the text it learned:\n\n```text\n"
        f"{held_out_runbooks(seed, 1)[0]}\n```\n"
    )
    (folder / presets.TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log(f"{name}: {n_params:,} parameters, {record['total_seconds']:.0f}s in all")
    return record
