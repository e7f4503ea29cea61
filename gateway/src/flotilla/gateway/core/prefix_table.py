"""The gateway's guess of which replica's prefix cache holds which prompt blocks.

The gateway never asks an engine what it caches: it remembers where it sent each prompt's block hashes
(flotilla.contract.prefix_block_hashes, the engine's own hashes), in an LRU table bounded like the caches
it models. A stale guess costs only a missed hit, never a wrong answer, so approximate is enough.

Not thread-safe: the gateway's event loop is its only user.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# Blocks per replica when the caller knows no better. A replica's KV pool is its KV memory over the bytes
# of one block: an 8B Llama with grouped-query attention in 16-bit keeps 128 KiB per token, 2 MiB per
# 16-token block, so ~60 GiB of an 80 GB GPU holds ~30k blocks; a 1B model holds ~120k. 65,536 is that
# order of magnitude (the table is a guess: too big keeps blocks the engine has evicted, too small forgets
# blocks it still has). An entry is an int, a small set and an OrderedDict link: a few hundred bytes, so a
# replica's worth is tens of MB at most.
DEFAULT_BLOCKS_PER_REPLICA = 65_536


def capacity_for(num_replicas: int, blocks_per_replica: int = DEFAULT_BLOCKS_PER_REPLICA) -> int:
    """Entries for `num_replicas` caches of `blocks_per_replica` blocks: their union, if all differ."""
    return max(1, num_replicas) * max(1, blocks_per_replica)


class PrefixTable:
    """block hash -> the endpoint urls believed to hold that block, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._holders: OrderedDict[int, set[str]] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._holders)

    def set_capacity(self, capacity_blocks: int) -> None:
        """Resize (replicas came or went), evicting down to the new size at once."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._evict()

    def match(self, hashes: list[int], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate url, how many leading blocks of `hashes` (from the first, up to the first it
        lacks) the table says it holds. Matched blocks become recently used."""
        counts = dict.fromkeys(candidates, 0)
        alive = set(counts)
        matched = 0
        for h in hashes:
            holders = self._holders.get(h)
            alive &= holders if holders is not None else set()
            if not alive:
                break
            for url in alive:
                counts[url] += 1
            matched += 1
        self._touch(hashes[:matched])
        return counts

    def record(self, hashes: list[int], url: str) -> None:
        """A request with these block hashes went to `url`: its cache will hold them."""
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {url}
            else:
                holders.add(url)
        self._touch(hashes)
        self._evict()

    def forget(self, url: str) -> None:
        """The endpoint is gone (or restarted with an empty cache). A scan of the table: endpoints change
        seldom next to requests, and a reverse index would double the table's memory."""
        for h in list(self._holders):
            holders = self._holders[h]
            holders.discard(url)
            if not holders:
                del self._holders[h]

    def _touch(self, hashes: list[int]) -> None:
        """Mark recently used, last block first, so that a prompt's first block is the most recent: the
        LRU then evicts a prefix from its tail, as the engine's cache does, and never leaves later blocks
        behind a missing first one (which `match`, stopping at the first miss, could never use)."""
        for h in reversed(hashes):
            if h in self._holders:
                self._holders.move_to_end(h)

    def _evict(self) -> None:
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)
