"""Gives requests KV blocks: per-request block tables on top of the block pool, and prefix caching by
chained block hashes. Plain Python; the model runner turns block tables into slot mappings.
"""

from __future__ import annotations

from collections.abc import Sequence

from flotilla.contract import prefix_block_hashes
from flotilla.engine.core.block_pool import BlockPool, KVBlock
from flotilla.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Per request: its blocks, and how many of them are registered in the prefix cache.
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_block_hashes(self, request: Request) -> None:
        prefix_block_hashes(request.all_token_ids, self.block_size, request.block_hashes, request.hash_root)

    def _hash_key(self, request: Request, index: int) -> tuple:
        bs = self.block_size
        parent = request.block_hashes[index - 1] if index else request.hash_root
        return (parent, tuple(request.all_token_ids[index * bs : (index + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks, leaving at least the last token to compute (its
        logits are needed). Returns the blocks (not yet referenced) and the number of tokens they hold."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(request.block_hashes[i], self._hash_key(request, i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make the request's block table cover its computed tokens, the cache hits, num_new_tokens more
        (computed in this step) and num_lookahead_tokens after those (slots reserved for a later step, e.g.
        speculative drafts). Returns False, changing nothing, when the pool cannot supply the blocks."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is None:
            blocks = self._blocks[rid] = []
        bs = self.block_size
        total_tokens = request.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        num_needed = -(-(total_tokens + num_lookahead_tokens) // bs) - len(blocks) - len(computed_blocks)
        if computed_blocks or num_needed > 0:
            # Unreferenced cache hits leave the free list when taken, so they count against it too.
            num_idle_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
            if max(num_needed, 0) + num_idle_hits > self.pool.num_free_blocks:
                if not blocks:
                    del self._blocks[rid]
                return False
            if computed_blocks:
                self.pool.touch(computed_blocks)
                blocks.extend(computed_blocks)
                request.block_ids.extend(b.block_id for b in computed_blocks)
                self._num_registered[rid] = len(blocks)
            if num_needed > 0:
                new = self.pool.allocate(num_needed)
                blocks.extend(new)
                request.block_ids.extend(b.block_id for b in new)
        # Decode steps usually stop here: a block is registered once, when it fills.
        if self.enable_prefix_caching and total_tokens // bs > self._num_registered.get(rid, 0):
            self._register_full_blocks(request, blocks, total_tokens)
        return True

    def _register_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Blocks that will be full once this step's tokens are written become findable now, so that
        requests admitted in the same step share them (each layer stores KV before attending)."""
        self._update_block_hashes(request)
        start = self._num_registered.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.register(blocks[i], request.block_hashes[i], self._hash_key(request, i))
        if end > start:
            self._num_registered[request.request_id] = end

    def release_unverified(self, request: Request) -> None:
        """After a step that sampled: the blocks past the request's computed (verified) tokens go back to
        the pool. They hold only rejected drafts' KV or slots reserved for drafts that were not proposed,
        and were never registered (registration stops at the full blocks of the request's known tokens).
        Without speculation there are none."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            del request.block_ids[keep:]
            self.pool.free_uncached(extra)

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        request.block_ids = []

    def owned_blocks(self) -> dict[str, list[int]]:
        """Block ids per request (for invariant checks and debugging)."""
        return {rid: [b.block_id for b in blocks] for rid, blocks in self._blocks.items()}

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
