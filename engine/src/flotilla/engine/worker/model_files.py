"""What the engine reads from the model folders before any weight (ModelFiles), and whether a draft model
can draft for the target: the same vocabulary, token for token, over the whole context. No torch here, so
`serve` reads and checks them before it listens, and hands them to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flotilla.contract import FLAG_SPECULATIVE_MODEL
from flotilla.engine.config import EngineConfig
from flotilla.engine.model.config import ModelConfig, ModelLoadError, check_quantization
from flotilla.engine.text.tokenizer import ModelTokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelFiles:
    """What the engine reads from the model folders before any weight: the model's config.json and
    tokenizer, and a draft model's config.json, each checked (int4 group sizes, the draft's vocabulary
    and context). Read once: `flotilla engine serve` loads them before it listens, to fail fast, and hands
    them to the engine, which reads them itself only when it is given none."""

    model_config: ModelConfig
    tokenizer: ModelTokenizer
    draft_config: ModelConfig | None = None

    @classmethod
    def load(cls, config: EngineConfig) -> ModelFiles:
        """Raises ModelLoadError or ValueError, naming the file or the setting."""
        folder = Path(config.model)
        model_config = ModelConfig.from_file(folder / "config.json")
        check_quantization(model_config, config.quantization, config.quantization_group_size)
        tokenizer = load_tokenizer(folder)
        draft_config = None
        if config.speculative_model:  # only with --speculative-method draft (EngineConfig checks)
            draft_config = check_draft_model(
                config.speculative_model, model_config, tokenizer, config.max_model_len
            )
        return cls(model_config, tokenizer, draft_config)


def check_draft_model(
    folder: str, target: ModelConfig, tokenizer: ModelTokenizer, max_model_len: int | None
) -> ModelConfig:
    """The draft's config, once it is known to speak the target's vocabulary over the whole context;
    otherwise a ModelLoadError that names the setting, the value and the rule."""
    path = Path(folder)
    context = max_model_len or target.max_position_embeddings
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{FLAG_SPECULATIVE_MODEL} {folder}: no config.json there (a model folder is needed)"
        )
    draft = ModelConfig.from_file(path / "config.json")
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"{FLAG_SPECULATIVE_MODEL} {folder}: its vocabulary has {draft.vocab_size} tokens, the model's "
            f"{target.vocab_size}; a draft model must share the model's tokenizer and vocabulary"
        )
    draft_vocab = load_tokenizer(path).tokenizer.get_vocab(with_added_tokens=True)
    target_vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differ = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ModelLoadError(
            f"{FLAG_SPECULATIVE_MODEL} {folder}: its tokenizer differs from the model's ({differ} token "
            "entries differ); a draft model must share the model's tokenizer and vocabulary"
        )
    if draft.max_position_embeddings < context:
        raise ModelLoadError(
            f"{FLAG_SPECULATIVE_MODEL} {folder}: it handles {draft.max_position_embeddings} positions, fewer "
            f"than the context of {context} tokens; a draft model must cover the whole context "
            "(lower --max-model-len or pick another draft)"
        )
    return draft
