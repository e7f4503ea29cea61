"""Turns the logits of the requests that sample this step into tokens (and logprobs).

Greedy rows take the argmax. Random rows get penalties, temperature, top-k, top-p and min-p, then an
exponential-race draw (argmax of p / Exp(1), the same as sampling from p). A request with a seed owns a
torch.Generator, so its draws do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.engine.core.outputs import SampledLogprob
from flotilla.engine.core.request import Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.kernels.greedy import first_max_indices

# The torch.profiler range around one step's sampling: `bench offline` groups it as sampling.
SAMPLER_LABEL = "flotilla.sampler"


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[SampledLogprob | None]  # per row


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = gen
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(p.has_penalties for p in params):
            logits = logits.clone()
            for row, request in enumerate(requests):
                if request.sampling_params.has_penalties:
                    _apply_penalties(logits[row], request)

        # The first maximum, as argmax gives it (kernels/greedy.py: torch's own took 0.35-0.85 ms of a 20 ms
        # bfloat16 step at 48 requests).
        tokens = first_max_indices(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows], [requests[i] for i in random_rows])

        token_list = tokens.tolist()
        logprobs: list = [None] * len(requests)
        if raw_logprobs is not None:
            for row, p in enumerate(params):
                if p.logprobs is None:
                    continue
                chosen = float(raw_logprobs[row, token_list[row]])
                top: list[tuple[int, float]] = []
                if p.logprobs > 0:
                    values, ids = raw_logprobs[row].topk(p.logprobs)
                    top = list(zip(ids.tolist(), values.tolist(), strict=True))
                logprobs[row] = (chosen, top)
        return SampleResult(token_list, logprobs)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = processed_probs(logits, [r.sampling_params for r in requests])
        return self.draw(probs, requests)

    def draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of probs (rows need not sum to 1): the argmax of p / Exp(1) noise, the noise
        from the row's request's generator when it has a seed."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[-1]), device=probs.device
            ).exponential_()
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                noise[i].exponential_(generator=self.generator(request))
        return (probs / noise).argmax(dim=-1)

    def uniform(self, request: Request, count: int) -> torch.Tensor:
        """count draws from U[0, 1), from the request's generator when it has a seed."""
        if request.sampling_params.seed is None:
            return torch.rand(count, device=self.device)
        return torch.rand(count, device=self.device, generator=self.generator(request))


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a random row samples from: temperature, then top-k, top-p and min-p (one row of
    params per row of logits; temperature > 0). Rows are probabilities that may no longer sum to 1 after
    min-p, which only matters up to normalisation."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits.float() / temps[:, None]
    vocab = logits.shape[-1]

    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks):
        kth = logits.topk(max(top_ks), dim=-1).values
        ks = torch.tensor(top_ks, device=logits.device) - 1
        kth = kth.gather(1, ks.clamp(max=kth.shape[1] - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))

    if any(p.top_p < 1.0 for p in params):
        top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))

    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=logits.device)
        floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    if p.repetition_penalty != 1.0:
        # As in transformers and vLLM: every token seen in the prompt or the output.
        seen = torch.tensor(sorted(set(request.all_token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, device=row.device)
        counts = torch.zeros_like(row).scatter_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
