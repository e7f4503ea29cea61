"""A model's tokenizer: tokenizer.json through `tokenizers`, special tokens and the chat template from
tokenizer_config.json (rendered with jinja2), defaults from generation_config.json.

One implementation for the two processes that must agree on a prompt's token ids: the engine, which serves
it, and the gateway, which hashes its blocks (flotilla.contract.prefix_block_hashes) to route it to the
replica whose prefix cache holds them. The engine reads a model folder; the gateway reads the same files'
contents from the engine (flotilla.contract.ENGINE_TOKENIZER_PATH). No torch.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken objects.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TokenizerFilesError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file and what is wrong."""


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise TokenizerFilesError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerFilesError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{path}: expected a JSON object")
    return data


class ModelTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict,
        generation_config: dict | None = None,
        source: str = "tokenizer_config.json",
    ) -> None:
        """From parsed files; `source` names where the config came from, for error messages."""
        self.tokenizer = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._special_id("bos_token", self.bos_token, source)
        self.eos_token_id = self._special_id("eos_token", self.eos_token, source)
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise TokenizerFilesError(f"{source}: field 'chat_template': expected a string")
        self.chat_template = template
        self._compiled_template = None
        self.generation_config = generation_config or {}
        self.special_ids = set(self.tokenizer.get_added_tokens_decoder())

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelTokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerFilesError(f"{path}: file not found (a fast tokenizer.json is needed)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerFilesError(f"{path}: cannot be read by `tokenizers`: {exc}") from exc
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path, required=True)
        generation_config = _read_json(folder / "generation_config.json", required=False)
        return cls(tokenizer, config, generation_config, source=str(config_path))

    @classmethod
    def from_contents(cls, tokenizer_json: str, config: dict) -> ModelTokenizer:
        """From the files' contents, as the engine serves them at ENGINE_TOKENIZER_PATH."""
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:
            raise TokenizerFilesError(f"tokenizer.json: cannot be read by `tokenizers`: {exc}") from exc
        return cls(tokenizer, config)

    def _special_id(self, field: str, text: str | None, path: str) -> int | None:
        if text is None:
            return None
        token_id = self.tokenizer.token_to_id(text)
        if token_id is None:
            raise TokenizerFilesError(f"{path}: field {field!r}: token {text!r} is not in tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json has no 'chat_template')")
        if self._compiled_template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself.
        return self.tokenizer.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        ).ids


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)


def plain_chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template sees them: content parts joined into one string, only
    role, content and name kept (both the engine and the gateway render from this)."""
    plain = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
        entry = {"role": m.get("role"), "content": content or ""}
        if m.get("name"):
            entry["name"] = m["name"]
        plain.append(entry)
    return plain
