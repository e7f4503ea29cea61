"""Sampling: greedy, temperature, top-k, top-p, min-p, seeds and penalties, on hand-made logits."""

from __future__ import annotations

import torch

from flotilla.engine.core.request import Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.worker.sampler import Sampler, _apply_penalties

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])


def request(rid="r", **params) -> Request:
    return Request(rid, [1, 2], SamplingParams(**params))


def sample(params_list, logits=LOGITS, sampler=None):
    sampler = sampler or Sampler(torch.device("cpu"))
    reqs = [request(f"r{i}", **p) for i, p in enumerate(params_list)]
    return sampler(logits.expand(len(reqs), -1).clone(), reqs)


def test_greedy_takes_the_argmax_and_reports_logprobs():
    out = sample([{"temperature": 0.0, "logprobs": 2}])
    assert out.token_ids == [5]
    assert out.logprobs[0] is not None
    chosen, top = out.logprobs[0]
    ref = torch.log_softmax(LOGITS[0], -1)
    assert abs(chosen - float(ref[5])) < 1e-6
    assert [t for t, _ in top] == [5, 0]


def test_filters_that_leave_one_token_are_greedy():
    for params in ({"top_k": 1}, {"top_p": 0.05}, {"min_p": 1.0}):
        for seed in range(5):
            assert sample([{"temperature": 1.0, "seed": seed, **params}]).token_ids == [5], params


def test_top_k_and_min_p_restrict_the_support():
    sampler = Sampler(torch.device("cpu"))
    seen_k, seen_p = set(), set()
    for _ in range(200):
        seen_k.update(sample([{"temperature": 5.0, "top_k": 2}], sampler=sampler).token_ids)
        seen_p.update(sample([{"temperature": 1.0, "min_p": 0.3}], sampler=sampler).token_ids)
    assert seen_k == {5, 0}
    # p(0)/p(5) = e^-1 ≈ 0.37 >= 0.3 survives; p(1)/p(5) = e^-2 ≈ 0.14 does not.
    assert seen_p == {5, 0}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS[0].softmax(-1)  # sorted: 5 (0.59), 0 (0.22), 1 (0.08) ...
    top_p = float(probs[5] + probs[0]) - 1e-3
    seen = set()
    for seed in range(200):
        seen.update(sample([{"temperature": 1.0, "top_p": top_p, "seed": seed}]).token_ids)
    assert seen == {5, 0}


def test_sampling_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"))
    counts = torch.zeros(6)
    logits = LOGITS.expand(4000, -1).clone()
    reqs = [request(f"r{i}", temperature=1.0) for i in range(4000)]
    torch.manual_seed(0)
    for t in sampler(logits, reqs).token_ids:
        counts[t] += 1
    assert torch.allclose(counts / 4000, LOGITS[0].softmax(-1), atol=0.03)


def test_a_seed_makes_output_reproducible_whatever_the_batch():
    a = Sampler(torch.device("cpu"))
    b = Sampler(torch.device("cpu"))
    alone = [a(LOGITS.clone(), [request("x", temperature=1.0, seed=7)]).token_ids[0] for _ in range(20)]
    mixed = []
    for _ in range(20):
        reqs = [request("other", temperature=1.0), request("x", temperature=1.0, seed=7)]
        mixed.append(b(LOGITS.expand(2, -1).clone(), reqs).token_ids[1])
    assert alone == mixed
    assert len(set(alone)) > 1  # it does sample


def test_penalties():
    r = Request(
        "r", [0, 0, 1], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    )
    r.append_output_token(4)
    r.append_output_token(4)
    row = LOGITS[0].clone()
    _apply_penalties(row, r)
    expected = LOGITS[0].clone()
    expected[0] = 2.0 / 2  # positive logits are divided
    expected[1] = 1.0 / 2
    expected[4] = -1.0 * 2 - (0.25 * 2 + 0.5)  # negative ones multiplied; then frequency and presence
    assert torch.allclose(row, expected)
