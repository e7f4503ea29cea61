"""CUDA graphs for decode steps: the model's forward over one token per request, captured once per batch
size and replayed, so a small batch pays one graph launch instead of a launch per kernel.

A step of B decoding requests runs the graph of the smallest captured size >= B. Its inputs are copied
into static buffers (a graph reads fixed addresses); the padding rows read and write only a scratch KV
block that the block pool never hands out, attend to one token, and their outputs are dropped. Attention
in a graph cannot size its launch from this step's lengths, so it splits every sequence as for the
longest one the engine allows (`decode_len_bound`); a split past a sequence's end has no tokens.

Off the GPU the same buffers, padding and metadata run eagerly (`capture=False`): the CPU tests check that
path against the plain forward, and only the capture itself is left to the GPU check.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flotilla.engine.kernels.attention import AttentionMetadata
from flotilla.engine.worker.batch import BatchRow

# vLLM's shape of default: small powers of two, then every 16 up to 256 (or max_num_seqs, if smaller).
DEFAULT_MAX_CAPTURE = 256

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending. `requested` must lie in 1..max_num_seqs (checked where the
    config is); by default 1, 2, 4, 8, then multiples of 16, up to min(max_num_seqs, 256), and that bound."""
    if requested:
        return sorted(set(requested))
    top = min(max_num_seqs, DEFAULT_MAX_CAPTURE)
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


def padded_size(sizes: Sequence[int], batch: int) -> int | None:
    """The captured size a batch of `batch` runs at: the smallest >= batch; None past the largest."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@dataclass
class StaticInputs:
    """The buffers every graph reads, sized for the largest batch; a graph of size N uses the first N rows."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_mapping: torch.Tensor  # [N] long
    block_tables: torch.Tensor  # [N, blocks per sequence] int32
    seq_lens: torch.Tensor  # [N] int32

    @classmethod
    def allocate(cls, size: int, table_width: int, device: torch.device) -> StaticInputs:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(size), zeros(size), zeros(size), zeros(size, table_width, dtype=torch.int32),
                   zeros(size, dtype=torch.int32))  # fmt: skip


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        *,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        capture: bool,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.capture = capture
        self.table_width = -(-max_model_len // block_size)
        self.inputs = StaticInputs.allocate(self.sizes[-1], self.table_width, device)
        self.metas = {n: self._meta(n) for n in self.sizes}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, n: int) -> AttentionMetadata:
        """Every row decodes; the tensors are views of the static buffers. The host lists are refilled for
        each eager run (the torch backends plan from them); a captured graph never reads them."""
        return AttentionMetadata(
            slot_mapping=self.inputs.slot_mapping[:n],
            query_start=list(range(n + 1)),
            context_lens=[0] * n,
            seq_lens=[1] * n,
            block_tables=self.inputs.block_tables[:n],
            seq_lens_tensor=self.inputs.seq_lens[:n],
            decode_requests=list(range(n)),
            prefill_requests=[],
            decode_token_index=torch.arange(n, device=self.device),
            decode_len_bound=self.max_model_len,
        )

    def covers(self, rows: Sequence[BatchRow]) -> bool:
        """Every row decodes one token and the batch fits the largest graph."""
        return 0 < len(rows) <= self.sizes[-1] and all(len(row.token_ids) == 1 for row in rows)

    def capture_all(self, progress: Callable[[str], None] = lambda _msg: None) -> None:
        """Captures each size, largest first (the smaller graphs then fit in the memory pool it made),
        after one eager run that compiles the kernels (compilation cannot happen inside a capture)."""
        if not self.capture:
            return
        self._pad_all()
        for n in reversed(self.sizes):
            progress(f"capturing the decode graph for batch {n}")
            meta = self.metas[n]
            self.forward(self.inputs.input_ids[:n], self.inputs.positions[:n], meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[n] = self.forward(self.inputs.input_ids[:n], self.inputs.positions[:n], meta)
            self.pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)

    def _pad_all(self) -> None:
        """Every row a padding row: what the capture runs on."""
        self._fill(self.sizes[-1], [], [], [], [])

    def _fill(self, n: int, ids, positions, slots, tables) -> list[int]:
        """The first n rows get the given values, those past them become padding rows; returns the n
        sequence lengths."""
        pad = n - len(ids)
        width, scratch = self.table_width, self.scratch_block
        buf = self.inputs
        buf.input_ids[:n].copy_(torch.tensor(list(ids) + [0] * pad), non_blocking=True)
        buf.positions[:n].copy_(torch.tensor(list(positions) + [0] * pad), non_blocking=True)
        scratch_slot = scratch * self.block_size
        buf.slot_mapping[:n].copy_(torch.tensor(list(slots) + [scratch_slot] * pad), non_blocking=True)
        lens = [p + 1 for p in positions] + [1] * pad
        buf.seq_lens[:n].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        # Positions stay below max_model_len, so no request needs more than `width` blocks here.
        table = [blocks[:width] + [scratch] * (width - len(blocks[:width])) for blocks in tables]
        table += [[scratch] * width] * pad
        buf.block_tables[:n].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        return lens

    def run(self, rows: Sequence[BatchRow]) -> torch.Tensor:
        """The hidden states [len(rows), hidden] of a decode step `covers` accepted."""
        n = padded_size(self.sizes, len(rows))
        assert n is not None
        bs = self.block_size
        positions = [row.start for row in rows]
        slots = [row.block_ids[p // bs] * bs + p % bs for row, p in zip(rows, positions, strict=True)]
        lens = self._fill(
            n, [row.token_ids[0] for row in rows], positions, slots, [row.block_ids for row in rows]
        )
        meta = self.metas[n]
        if n in self.graphs:
            self.graphs[n].replay()
            return self.outputs[n][: len(rows)]
        # Eager: the same buffers and padding, with this step's host lists for the torch backends' plans.
        meta.seq_lens = lens
        meta.context_lens = [length - 1 for length in lens]
        meta.backend_cache.clear()
        return self.forward(self.inputs.input_ids[:n], self.inputs.positions[:n], meta)[: len(rows)]
