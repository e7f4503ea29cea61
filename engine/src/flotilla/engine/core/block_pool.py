"""The pool of KV-cache blocks: reference counts, an O(1) free list that is also the LRU order, and the
prefix-cache map from block hash to block.

A block whose reference count drops to zero goes to the tail of the free list but keeps its hash, so a
later request with the same prefix can take it back (a cache hit). New allocations pop from the head,
evicting the least recently freed cached block first.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # (parent hash, token ids): compared on lookup, so a hash collision is never a false hit.
        self.hash_key: tuple | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list: popleft, append and remove from the middle are all O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, or cached but unreferenced (evictable)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; an unreferenced hit leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order (callers pass a request's blocks last-first, so
        its tail blocks, the least likely to be shared, are evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def free_uncached(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each on blocks that hold nothing worth caching (rejected drafts' KV): at
        zero they go to the head of the free list, so they are reused before any cached block is evicted."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            assert block.block_hash is None, f"{block} is in the prefix cache"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.appendleft(block)

    def lookup(self, block_hash: int, hash_key: tuple) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.hash_key != hash_key:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, hash_key: tuple) -> None:
        """Make a full, computed block findable by its hash. The first block with a given content wins;
        a duplicate stays private to its request."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.hash_key = hash_key
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.hash_key = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)

    def evict_chain(self, root: int) -> int:
        """Forgets every cached block whose chain of hashes starts at `root` (an unloaded LoRA adapter's:
        a later adapter of the same name must not find KV computed with these weights). Returns how many.
        The caller makes sure no request holds them."""
        children: dict[int, list[KVBlock]] = {}
        for block in self.cached.values():
            assert block.hash_key is not None
            children.setdefault(block.hash_key[0], []).append(block)
        evicted, frontier = 0, [root]
        while frontier:
            for block in children.pop(frontier.pop(), []):
                assert block.ref_cnt == 0, f"{block} is in use"
                assert block.block_hash is not None
                frontier.append(block.block_hash)
                self._evict(block)
                evicted += 1
        return evicted
