"""The prefix table: which replica is believed to hold which leading blocks of a prompt."""

from __future__ import annotations

import pytest

from flotilla.contract import prefix_block_hashes
from flotilla.gateway.core.prefix_table import DEFAULT_BLOCKS_PER_REPLICA, PrefixTable, capacity_for

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
SYSTEM = list(range(1000, 1064))  # a 64-token system prompt: 4 blocks of 16


def hashes(tokens: list[int]) -> list[int]:
    return prefix_block_hashes(tokens, 16)


def test_match_counts_leading_blocks_per_candidate() -> None:
    table = PrefixTable(100)
    first = hashes(SYSTEM + list(range(32)))  # 6 blocks
    table.record(first, A)
    table.record(hashes(SYSTEM[:32]), B)  # only the first two blocks
    same_system = hashes(SYSTEM + list(range(500, 532)))  # shares the 4 system blocks only
    assert table.match(same_system, [A, B, C]) == {A: 4, B: 2, C: 0}
    assert table.match(first, [A]) == {A: 6}
    assert table.match(hashes(list(range(64))), [A, B]) == {A: 0, B: 0}


def test_match_stops_at_the_first_missing_block() -> None:
    table = PrefixTable(100)
    h = hashes(list(range(64)))
    table.record([h[0], h[2], h[3]], A)
    assert table.match(h, [A]) == {A: 1}


def test_lru_evicts_the_least_recently_used_prompt_tail_first() -> None:
    table = PrefixTable(6)
    old, new = hashes(list(range(64))), hashes(list(range(100, 132)))  # 4 and 2 blocks
    table.record(old, A)
    table.record(new, B)
    assert len(table) == 6
    table.record(hashes(list(range(200, 216))), C)  # one more block: one must go
    assert len(table) == 6
    # The oldest prompt loses its last block, not its first: its first three still match.
    assert table.match(old, [A]) == {A: 3}
    assert table.match(new, [B]) == {B: 2}


def test_match_touches_so_a_used_prefix_survives() -> None:
    table = PrefixTable(4)
    p, q = hashes(list(range(32))), hashes(list(range(100, 132)))
    table.record(p, A)
    table.record(q, B)
    assert table.match(p, [A]) == {A: 2}  # p is now the most recent
    table.record(hashes(list(range(200, 232))), C)  # two new blocks evict two old ones: q's
    assert table.match(p, [A]) == {A: 2}
    assert table.match(q, [B]) == {B: 0}


def test_forget_removes_an_endpoint_everywhere() -> None:
    table = PrefixTable(100)
    h = hashes(SYSTEM)
    table.record(h, A)
    table.record(h, B)
    table.record(hashes(list(range(16))), A)
    table.forget(A)
    assert table.match(h, [A, B]) == {A: 0, B: 4}
    assert len(table) == 4  # A's own block is gone with it


def test_set_capacity_evicts_at_once() -> None:
    table = PrefixTable(10)
    table.record(hashes(list(range(160))), A)
    table.set_capacity(3)
    assert len(table) == 3 and table.capacity == 3
    with pytest.raises(ValueError):
        table.set_capacity(0)


def test_capacity_for() -> None:
    assert capacity_for(3, 1000) == 3000
    assert capacity_for(0, 1000) == 1000  # a service at zero keeps a replica's worth
    assert capacity_for(2) == 2 * DEFAULT_BLOCKS_PER_REPLICA
    with pytest.raises(ValueError):
        PrefixTable(0)
