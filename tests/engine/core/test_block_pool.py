"""Block pool and KV cache manager: reference counts, LRU free list, prefix caching. No torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flotilla.engine.core.block_pool import BlockPool
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.request import Request
from flotilla.engine.core.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_scheduler_and_block_manager_import_no_torch():
    # Other tests import torch into this process, so check in a fresh one.

    code = (
        "import sys; import flotilla.engine.core.scheduler, flotilla.engine.core.kv_cache_manager, "
        "flotilla.engine.core.block_pool; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_free_list_is_lru_and_freed_blocks_go_last_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([b, a])  # a request frees its blocks last-first
    assert [blk.block_id for blk in pool.free_queue] == [2, 3, 1, 0]
    assert pool.allocate(1)[0].block_id == 2


def test_touch_removes_an_idle_cached_block_from_the_free_list():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, 123, (0, (1, 2)))
    pool.free([a])
    assert pool.num_free_blocks == 3
    assert pool.lookup(123, (0, (1, 2))) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2


def test_lookup_checks_the_content_not_only_the_hash():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.register(a, 7, (0, (1, 2)))
    assert pool.lookup(7, (0, (9, 9))) is None  # same hash, different tokens: a collision, not a hit


def test_eviction_drops_the_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.register(a, 5, (0, (1,)))
    pool.free([a])
    (again,) = pool.allocate(1)
    assert again is a and a.block_hash is None and pool.lookup(5, (0, (1,))) is None


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    kv.free(first)
    second = make_request("b", list(range(12)))
    blocks, hit_tokens = kv.get_computed_blocks(second)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: only 2 blocks are hits.
    assert hit_tokens == 8 and [b.block_id for b in blocks] == first_block_ids(kv, 2)
    longer = make_request("c", list(range(13)))
    _, hit_tokens = kv.get_computed_blocks(longer)
    assert hit_tokens == 12


def first_block_ids(kv: KVCacheManager, n: int) -> list[int]:
    return [kv.pool.cached[h].block_id for h in list(kv.pool.cached)[:n]]


def test_partial_block_is_never_shared():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6)
    assert len(kv.pool.cached) == 1  # only the full first block
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 4


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    b = make_request("b", list(range(9)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.allocate_slots(b, 1, blocks)
    assert a.block_ids[:2] == b.block_ids[:2] and a.block_ids[2] != b.block_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a.block_ids[:2]] == [2, 2]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in b.block_ids[:2]] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 6


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(12)))
    assert not kv.allocate_slots(a, 12)
    assert a.block_ids == [] and kv.pool.num_free_blocks == 2 and kv.owned_blocks() == {}


def test_idle_cache_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 4
    # 2 hit blocks (idle) + 3 new ones > 3 free: refuse rather than evict a block we are about to use.
    assert not kv.allocate_slots(b, 5, blocks)
    assert kv.pool.num_free_blocks == 3


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3])) == ([], 0)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
