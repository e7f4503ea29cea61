"""The engine's tokenizer: the shared one (flotilla.tokenizer, which the gateway uses too, so both agree on a
prompt's token ids), read from the model folder, its file errors reported as ModelLoadError."""

from __future__ import annotations

from pathlib import Path

from flotilla.engine.model.config import ModelLoadError
from flotilla.tokenizer import ModelTokenizer, TokenizerFilesError, plain_chat_messages

__all__ = ["ModelTokenizer", "load_tokenizer", "plain_chat_messages"]


def load_tokenizer(folder: str | Path) -> ModelTokenizer:
    try:
        return ModelTokenizer.from_folder(folder)
    except TokenizerFilesError as exc:
        raise ModelLoadError(str(exc)) from exc
