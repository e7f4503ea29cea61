"""Drafts from a smaller model with the target's tokenizer, in the same paged KV layout.

The draft model keeps its own KV tensors, but indexed by the same block tables as the target's: the
scheduler gives a request its blocks once, and both models write a token's KV into the same slot of their
own cache. A request's draft KV is valid for its first num_draft_computed_tokens tokens (the scheduler
cuts that back to the verified tokens after each step, and to 0 on preemption). Proposing feeds the
tokens the draft has not seen, then its own drafts one at a time, all requests in one batch per round.
"""

from __future__ import annotations

import torch

from flotilla.engine.core.request import Request
from flotilla.engine.kernels.linear import pack_for_cpu
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.loader import load_model
from flotilla.engine.worker.batch import BatchRow, build_batch
from flotilla.engine.worker.kv_storage import zeroed
from flotilla.engine.worker.sampler import Sampler, processed_probs


class DraftProposer:
    def __init__(
        self,
        folder: str,
        config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        backend,
        sampler: Sampler,
        show_progress: bool = False,
    ) -> None:
        self.config = config
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.model = load_model(folder, dtype, device, max_model_len, show_progress, config=config)
        pack_for_cpu(self.model)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            (zeroed(shape, dtype, device), zeroed(shape, dtype, device))
            for _ in range(config.num_hidden_layers)
        ]
        # Per request, the distributions its last drafts were drawn from ([k, V]), for the rejection
        # sampler; absent for greedy requests, whose drafts are the draft's argmax.
        self._probs: dict[str, torch.Tensor] = {}

    def take_probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """k drafts for each (request, k). Their KV slots must be reserved (Scheduler.reserve_draft_slots)."""
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        active = list(range(len(batch)))
        rows = []
        for request, _k in batch:
            start = request.num_draft_computed_tokens
            rows.append(BatchRow(request.all_token_ids[start:], start, request.block_ids))
        while active:
            step = build_batch(rows, self.block_size, self.device)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, self.backend)
            last = torch.tensor([end - 1 for end in step.row_ends], device=self.device)
            logits = self.model.compute_logits(hidden[last])
            requests = [batch[i][0] for i in active]
            tokens, token_probs = self._draw(logits, requests)
            for j, i in enumerate(active):
                request = requests[j]
                request.num_draft_computed_tokens = rows[j].start + len(rows[j].token_ids)
                drafts[i].append(tokens[j])
                if token_probs is not None and not request.sampling_params.greedy:
                    probs[i].append(token_probs[j])
            active = [i for i in active if len(drafts[i]) < batch[i][1]]
            # Draft d_j sits at position num_tokens - 1 + j; feeding it there drafts d_{j+1}.
            rows = [
                BatchRow([drafts[i][-1]], batch[i][0].num_tokens - 1 + len(drafts[i]), batch[i][0].block_ids)
                for i in active
            ]
        for (request, _k), request_probs in zip(batch, probs, strict=True):
            if request_probs:
                self._probs[request.request_id] = torch.stack(request_probs)
            else:
                self._probs.pop(request.request_id, None)
        return drafts

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], torch.Tensor | None]:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not random_rows:
            return tokens.tolist(), None
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        chosen = [requests[i] for i in random_rows]
        q = processed_probs(logits[random_rows], [r.sampling_params for r in chosen])
        q = q / q.sum(dim=-1, keepdim=True)
        probs[random_rows] = q
        tokens[random_rows] = self.sampler.draw(q, chosen)
        return tokens.tolist(), probs
