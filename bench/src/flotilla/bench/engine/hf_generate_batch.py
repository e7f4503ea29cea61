"""transformers' own continuous batching, `model.generate_batch`, over a bench workload (offline.py's
Workload), greedy with no end-of-sequence token, so each request runs to its output length.

generate_batch takes one `max_new_tokens` for all its prompts, so requests are run in groups of one output
length (one group when the workload's output lengths are all equal, as `bench gpu` makes them). Two rates:
`tokens_per_s` over the wall time of the calls (the manager's setup and warm-up included) and
`tokens_per_s_active` over the span from the first request scheduled to the last finished, from the
requests' own lifespans when transformers records them. Callers comparing against the engine should take
the larger (`best_tokens_per_s`): the comparison is then the one least favourable to the engine.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any


def group_by_output_len(output_lens: Sequence[int]) -> dict[int, list[int]]:
    """Output length -> the indices of the requests with it, in order."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(output_lens):
        groups.setdefault(n, []).append(i)
    return groups


def active_span(lifespans: Sequence[tuple[float, float]]) -> float | None:
    """From the first request scheduled to the last finished; None when no lifespan was recorded
    (transformers leaves (-1, -1))."""
    valid = [(a, b) for a, b in lifespans if a > 0 and b >= a]
    if not valid:
        return None
    return max(b for _, b in valid) - min(a for a, _ in valid)


def hf_generate_batch(model, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                      continuous_batching: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Runs the prompts through model.generate_batch. `continuous_batching`: fields of transformers'
    ContinuousBatchingConfig (e.g. num_blocks, to keep its cache small on the CPU), where this transformers
    has one. Returns {"available": False, "reason": ...} when it has no generate_batch."""
    import transformers
    from transformers import GenerationConfig

    version = transformers.__version__
    generate_batch = getattr(model, "generate_batch", None)
    if generate_batch is None:
        return {
            "available": False,
            "reason": f"transformers {version} has no generate_batch",
            "transformers": version,
        }
    extra: dict[str, Any] = {}
    if continuous_batching and "continuous_batching_config" in inspect.signature(generate_batch).parameters:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        extra["continuous_batching_config"] = ContinuousBatchingConfig(**continuous_batching)
    produced, failed, spans = 0, 0, []
    groups = group_by_output_len(output_lens)
    start = time.perf_counter()
    for out_len, indices in groups.items():
        config = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        results = generate_batch([list(prompts[i]) for i in indices], generation_config=config,
                                 progress_bar=False, **extra)  # fmt: skip
        lifespans = []
        for result in results.values():
            produced += len(result.generated_tokens)
            failed += result.error is not None
            lifespans.append(tuple(getattr(result, "lifespan", (-1, -1))))
        failed += len(indices) - len(results)
        spans.append(active_span(lifespans))
    elapsed = time.perf_counter() - start
    active = None if None in spans else sum(s for s in spans if s is not None)
    out: dict[str, Any] = {
        "available": True,
        "transformers": version,
        "seconds": elapsed,
        "output_tokens": produced,
        "expected_output_tokens": sum(output_lens),
        "failed_requests": failed,
        "calls": len(groups),
        "tokens_per_s": produced / elapsed,
        "active_seconds": active,
        "tokens_per_s_active": produced / active if active else None,
    }
    out["best_tokens_per_s"] = max(
        r for r in (out["tokens_per_s"], out["tokens_per_s_active"]) if r is not None
    )
    return out
