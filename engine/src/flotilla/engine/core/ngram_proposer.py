"""N-gram prompt lookup: drafts without a draft model.

The last n tokens of a request (n from max_n down to min_n) are looked up among its earlier tokens,
prompt and output alike; the tokens that followed their latest earlier occurrence are the drafts. Text
that copies from its prompt (code that reuses names, edits, extraction) is where this pays. Each request
keeps an index from n-gram to the latest position it started at, extended as tokens arrive, so a lookup
costs O(max_n) per step whatever the context length. Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.engine.core.request import Request


@dataclass
class _Index:
    # tables[n][tuple of n tokens] = the latest start of that n-gram that has a token after it.
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    num_indexed: int = 0  # every n-gram ending before all_token_ids[num_indexed] is in the tables


class NgramProposer:
    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[str, _Index] = {}

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k); an empty list where nothing matches."""
        return [self.propose_one(request, k) for request, k in batch]

    def propose_one(self, request: Request, k: int) -> list[int]:
        tokens = request.all_token_ids
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index(
                {n: {} for n in range(self.min_n, self.max_n + 1)}
            )
        self._extend(index, tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            start = index.tables[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        # An n-gram starting at i is indexed once its next token exists: i + n <= len(tokens) - 1.
        end = len(tokens) - 1
        for n, table in index.tables.items():
            for i in range(max(index.num_indexed - n + 1, 0), end - n + 1):
                table[tuple(tokens[i : i + n])] = i
        index.num_indexed = end
