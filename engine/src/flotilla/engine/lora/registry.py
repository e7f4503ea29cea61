"""The adapters loaded in host memory, by name: at most --max-cpu-loras of them.

Loading reads and checks the whole folder first (adapter.py), so a refused adapter leaves nothing
registered. The registry does not know which requests use an adapter; the engine refuses to unload one
that unfinished requests still use (LLMEngine.unload_lora).
"""

from __future__ import annotations

import torch

from flotilla.contract import FLAG_MAX_CPU_LORAS
from flotilla.engine.lora.adapter import LoRAAdapter, load_adapter
from flotilla.engine.lora.errors import LoRAError
from flotilla.engine.lora.source import AdapterSource
from flotilla.engine.model.config import ModelConfig


class LoRARegistry:
    def __init__(
        self, base: ModelConfig, base_names: set[str], max_rank: int, max_adapters: int, dtype: torch.dtype
    ) -> None:
        self.base = base
        self.base_names = base_names  # the names requests use for the base model: no adapter may take one
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self.dtype = dtype
        self.adapters: dict[str, LoRAAdapter] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def get(self, name: str) -> LoRAAdapter:
        return self.adapters[name]

    def names(self) -> list[str]:
        return list(self.adapters)

    def check_new(self, name: str) -> None:
        """Refuses a name before anything is read: empty, the base model's, or taken; or no room left."""
        if not name or not name.strip():
            raise LoRAError("lora_name must not be empty", "lora_name")
        if name in self.base_names:
            raise LoRAError(f"lora_name {name!r} is the base model's name", "lora_name")
        if name in self.adapters:
            raise LoRAError(
                f"lora_name {name!r} is already loaded (from {self.adapters[name].path}); unload it first",
                "lora_name",
            )
        if len(self.adapters) >= self.max_adapters:
            raise LoRAError(
                f"{len(self.adapters)} adapters are loaded, the most {FLAG_MAX_CPU_LORAS} allows "
                f"({self.max_adapters}); unload one first",
                "lora_name",
            )

    def load(self, name: str, source: AdapterSource) -> LoRAAdapter:
        """Reads and checks the folder `source` resolved to, then registers it; its `path` is what the engine
        shows (the folder, or the URI it was fetched from, without secrets)."""
        self.check_new(name)
        try:
            adapter = load_adapter(name, source.folder, self.base, self.max_rank, self.dtype)
        except LoRAError as exc:
            if not source.fetched:
                raise
            # The message names the cache folder's files: say which lora_path they came from.
            raise LoRAError(
                f"lora_path {source.shown!r} (fetched into {source.folder}): {exc}", exc.field
            ) from exc
        adapter.path = source.shown
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        return self.adapters.pop(name)
