"""Whether a draft model can draft for the target: the same vocabulary, token for token, over the whole
context. Checked at start-up, before anything loads (no torch here, so `serve` checks it before listening)."""

from __future__ import annotations

from pathlib import Path

from flotilla.contract import FLAG_SPECULATIVE_MODEL
from flotilla.engine.model.config import ModelConfig, ModelLoadError
from flotilla.engine.text.tokenizer import ModelTokenizer, load_tokenizer


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
