"""`flotilla model ...`: create, fetch and inspect model folders. Import-light: torch loads inside commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flotilla.contract import FLAG_FETCH_DEST, MODEL_FETCH
from flotilla.engine.model.synthetic.demo_adapter import ADAPTER_PRESETS
from flotilla.engine.model.synthetic.presets import PRESETS, TRAINED_PRESETS


def add_commands(subparsers) -> None:
    init = subparsers.add_parser(
        "init",
        help="write a tiny model folder: random weights, or trained on a synthetic corpus (for demos and tests)",
        description="Write a tiny model folder. tiny-llama and tiny-qwen2 are deterministic random-weight "
        "models with a freshly trained BPE tokenizer: they produce meaningless text. "
        f"{' and '.join(TRAINED_PRESETS)} are trained on Flotilla's synthetic corpus (templated sentences, "
        "lists, code-like lines) on first use, in under three minutes on two CPU cores, then cached under "
        "~/.cache/flotilla/models; they share one tokenizer, and the second is the draft model of the first.",
    )
    init.add_argument("--preset", required=True, choices=list(PRESETS))
    init.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    init.add_argument("dir", type=Path, help="folder to write (created if missing)")
    init.set_defaults(func=_init)

    adapter = subparsers.add_parser(
        "init-adapter",
        help="write the demo LoRA adapter: tiny-trained fine-tuned on deploy runbooks (a PEFT folder)",
        description="Write a demo LoRA adapter folder (adapter_config.json, adapter_model.safetensors). "
        "tiny-trained-runbook is tiny-trained fine-tuned, in seconds on two CPU cores, on one kind of its "
        "corpus's documents, the deploy steps, in a house style (every step, the config file first); "
        "trained on first use (tiny-trained too, if it is not cached), then cached under "
        "~/.cache/flotilla/models.",
    )
    adapter.add_argument("--preset", required=True, choices=list(ADAPTER_PRESETS))
    adapter.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    adapter.add_argument("dir", type=Path, help="folder to write (created if missing)")
    adapter.set_defaults(func=_init_adapter)

    info = subparsers.add_parser("info", help="check that a model folder loads and describe it")
    info.add_argument("dir", type=Path)
    info.set_defaults(func=_info)

    fetch = subparsers.add_parser(
        MODEL_FETCH[-1],
        help="download a model folder from the Hugging Face Hub or a tar archive",
        description="Download a model folder into --dest, atomically: the folder appears only once complete. "
        "A --dest that already holds a model folder is left as it is. "
        "hf:// honours HF_ENDPOINT and HF_TOKEN.",
    )
    fetch.add_argument("uri", help="hf://org/name[@revision] or http(s)://…/model.tar.gz[#sha256=<hex>]")
    fetch.add_argument(FLAG_FETCH_DEST, type=Path, required=True, help="the model folder to create")
    fetch.set_defaults(func=_fetch)


def _init(args: argparse.Namespace) -> int:
    from flotilla.engine.model.synthetic.presets import init_model

    if args.dir.exists() and any(args.dir.iterdir()):
        print(f"flotilla model init: {args.dir} exists and is not empty", file=sys.stderr)
        return 2
    folder = init_model(args.preset, args.dir, seed=args.seed)
    kind = "trained" if "training" in PRESETS[args.preset] else "random weights"
    print(f"wrote {args.preset} ({kind}) to {folder}")
    return 0


def _init_adapter(args: argparse.Namespace) -> int:
    from flotilla.engine.model.synthetic.demo_adapter import init_adapter

    if args.dir.exists() and any(args.dir.iterdir()):
        print(f"flotilla model init-adapter: {args.dir} exists and is not empty", file=sys.stderr)
        return 2
    folder = init_adapter(args.preset, args.dir, seed=args.seed)
    print(f"wrote {args.preset} (a LoRA adapter of {ADAPTER_PRESETS[args.preset]['base']}) to {folder}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from flotilla.engine.model.config import ModelConfig, ModelLoadError
    from flotilla.engine.text.tokenizer import load_tokenizer

    try:
        config = ModelConfig.from_file(args.dir / "config.json")
        tokenizer = load_tokenizer(args.dir)
    except ModelLoadError as exc:
        print(f"flotilla model info: {exc}", file=sys.stderr)
        return 2
    summary = {
        "architecture": config.architecture,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "tokenizer_vocab": tokenizer.vocab_size,
        "chat_template": tokenizer.chat_template is not None,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from flotilla.engine.model.fetch import FetchError, fetch_model, redact_uri

    shown = redact_uri(args.uri)
    try:
        fetched = fetch_model(args.uri, args.dest)
    except FetchError as exc:
        print(f"flotilla model fetch: {shown}: {exc}", file=sys.stderr)
        return exc.exit_code
    if fetched:
        print(f"fetched {shown} into {args.dest}")
    else:
        print(f"{args.dest} already holds a model folder (config.json): nothing to fetch")
    return 0
