"""One forward pass's flat inputs and paged-attention metadata, for the target model and the draft model
alike: each row is a chunk of new tokens of one request, at consecutive positions, with its block table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flotilla.engine.kernels.attention import AttentionMetadata


@dataclass(slots=True)
class BatchRow:
    token_ids: Sequence[int]  # the new tokens
    start: int  # the position of the first; KV exists for the positions before it
    block_ids: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata

    @property
    def row_ends(self) -> list[int]:
        """Per row, the index after its last token in the flat batch."""
        return self.meta.query_start[1:]


def build_batch(rows: Sequence[BatchRow], block_size: int, device: torch.device) -> Batch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens, seq_lens, tables = [], [], []
    decode_reqs, prefill_reqs, decode_rows = [], [], []
    for r, row in enumerate(rows):
        n, start, blocks = len(row.token_ids), row.start, row.block_ids
        input_ids.extend(row.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if n == 1:
            decode_reqs.append(r)
            decode_rows.append(query_start[-1])
        else:
            prefill_reqs.append(r)
        query_start.append(query_start[-1] + n)
        context_lens.append(start)
        seq_lens.append(start + n)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        query_start=query_start,
        context_lens=context_lens,
        seq_lens=seq_lens,
        block_tables=table_tensor.to(device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        decode_requests=decode_reqs,
        prefill_requests=prefill_reqs,
        decode_token_index=torch.tensor(decode_rows, dtype=torch.long).to(device),
    )
    ids = torch.tensor(input_ids, dtype=torch.long).to(device)
    pos = torch.tensor(positions, dtype=torch.long).to(device)
    return Batch(ids, pos, meta)
