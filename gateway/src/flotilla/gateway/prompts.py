"""A request's prompt as the engine will see it: token ids from the engine's own tokenizer (fetched once
per service from a replica, at flotilla.contract.ENGINE_TOKENIZER_PATH, and run here through the shared
flotilla.tokenizer), and the chained hashes of its full KV blocks (flotilla.contract.prefix_block_hashes).
So a block the gateway predicts a replica holds is one the replica's prefix cache can find.

Anything that fails here (no replica to ask yet, a prompt the template refuses) only costs the prefix
signal: the request is routed by load, and the engine reports its own errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass

import httpx

from flotilla.contract import ENGINE_TOKENIZER_PATH, prefix_block_hashes, root_block_hash
from flotilla.tokenizer import ModelTokenizer, plain_chat_messages

log = logging.getLogger("flotilla.gateway.prompts")
RETRY_AFTER_FAILURE = 10.0  # seconds before asking a service's replicas for its tokenizer again


@dataclass(frozen=True)
class ServiceTokenizer:
    tokenizer: ModelTokenizer
    block_size: int
    prefix_caching: bool
    num_blocks: int  # one replica's KV blocks: sizes the gateway's prefix table


def prompt_ids(tokenizer: ModelTokenizer, chat: bool, body: dict) -> list[int] | None:
    """The first prompt's token ids, as the engine's server builds them; None when the body has none."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        return tokenizer.encode_chat(
            plain_chat_messages(messages), bool(body.get("add_generation_prompt", True))
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


class PromptHasher:
    def __init__(self, fetch_timeout: float = 10.0) -> None:
        self.client = httpx.AsyncClient(timeout=fetch_timeout)
        self.tokenizers: dict[Hashable, ServiceTokenizer] = {}
        self.failed_at: dict[Hashable, float] = {}
        self.fetching: dict[Hashable, asyncio.Task] = {}

    def known(self, key: Hashable) -> ServiceTokenizer | None:
        return self.tokenizers.get(key)

    async def hashes(
        self, key: Hashable, endpoints: list[str], chat: bool, body: dict, lora_name: str | None = None
    ) -> tuple[int, list[int]]:
        """(prompt tokens, block hashes); (0, []) when unknown. `key` names the base service (an adapter
        uses its base's tokenizer); a request for LoRA adapter `lora_name` chains its blocks from that
        adapter's root, as the engine's prefix cache does, so no hit is predicted across adapters."""
        entry = await self._tokenizer(key, endpoints)
        if entry is None:
            return 0, []
        try:
            ids = prompt_ids(entry.tokenizer, chat, body)
        except Exception as exc:  # the engine will refuse the same prompt with its own message
            log.debug("cannot tokenize a prompt for %s: %s", key, exc)
            return 0, []
        if not ids:
            return 0, []
        root = root_block_hash(lora_name)
        hashes = prefix_block_hashes(ids, entry.block_size, root=root) if entry.prefix_caching else []
        return len(ids), hashes

    async def _tokenizer(self, key: Hashable, endpoints: list[str]) -> ServiceTokenizer | None:
        entry = self.tokenizers.get(key)
        if entry is not None or not endpoints:
            return entry
        failed_at = self.failed_at.get(key)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER_FAILURE:
            return None
        task = self.fetching.get(key)
        if task is None:  # one fetch per service, however many requests wait on it
            task = self.fetching[key] = asyncio.ensure_future(self._fetch(key, endpoints))
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self.fetching.pop(key, None)

    async def _fetch(self, key: Hashable, endpoints: list[str]) -> ServiceTokenizer | None:
        for url in endpoints:
            try:
                rsp = await self.client.get(url + ENGINE_TOKENIZER_PATH)
                rsp.raise_for_status()
                data = rsp.json()
                tokenizer = ModelTokenizer.from_contents(data["tokenizer_json"], data["tokenizer_config"])
                entry = ServiceTokenizer(
                    tokenizer, int(data["block_size"]), bool(data["prefix_caching"]), int(data["num_blocks"])
                )
                self.tokenizers[key] = entry
                return entry
            except Exception as exc:
                log.warning("no tokenizer from %s for %s: %s", url, key, exc)
        self.failed_at[key] = time.monotonic()
        return None

    def forget(self, keep: set) -> None:
        """Drops tokenizers of services that are gone (or whose model changed: the key holds the URI)."""
        for key in [k for k in self.tokenizers if k not in keep]:
            del self.tokenizers[key]

    async def close(self) -> None:
        await self.client.aclose()
