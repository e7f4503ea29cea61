"""Verifies a request's draft tokens against the target model's logits at their positions, keeping the
output distribution exactly the target's (speculative sampling, Leviathan et al. and Chen et al. 2023).

For drafts d_1..d_k proposed from distributions q_1..q_k (one-hot for n-gram lookup), with the target's
processed distributions p_1..p_{k+1} at the same positions: d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection one token is drawn from norm(max(0, p_i - q_i)) and
the rest are dropped; when every draft is accepted, a bonus token is drawn from p_{k+1}. Greedy requests
accept a draft when it is the target's argmax and end with the argmax at the first mismatch, which is the
plain greedy output token for token.
"""

from __future__ import annotations

import torch

from flotilla.engine.core.request import Request
from flotilla.engine.worker.sampler import Sampler, processed_probs


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # for the requests' seeded generators and the draw

    @torch.no_grad()
    def __call__(
        self, logits: torch.Tensor, request: Request, drafts: list[int], draft_probs: torch.Tensor | None
    ) -> list[int]:
        """logits: [k+1, V], the target's at the last known token and at each draft; draft_probs: [k, V]
        or None for drafts that were certain (n-gram). Returns the accepted drafts and one more token."""
        k = len(drafts)
        params = request.sampling_params
        if params.greedy:
            best = logits.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < k and best[accepted] == drafts[accepted]:
                accepted += 1
            return drafts[:accepted] + [best[accepted]]

        probs = processed_probs(logits, [params] * (k + 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        draft_ids = torch.tensor(drafts, device=probs.device)
        rows = torch.arange(k, device=probs.device)
        p_draft = probs[rows, draft_ids]
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[rows, draft_ids].float()
        accept = self.sampler.uniform(request, k) < (p_draft / q_draft).clamp(max=1.0)
        rejected = (~accept).nonzero()
        if rejected.numel() == 0:
            bonus = self.sampler.draw(probs[k : k + 1], [request])
            return drafts + [int(bonus)]
        first = int(rejected[0])
        if draft_probs is None:
            residual = probs[first].clone()
            residual[drafts[first]] = 0.0
        else:
            residual = (probs[first] - draft_probs[first].float()).clamp(min=0.0)
        if not residual.sum() > 0:
            residual = probs[first]  # p <= q everywhere only when p == q, and then nothing is rejected
        token = self.sampler.draw(residual[None], [request])
        return drafts[:first] + [int(token)]
