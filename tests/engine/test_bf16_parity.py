"""bfloat16 on the CPU (oneDNN's bfloat16 linear layers, the compiled decode kernel over bfloat16 caches)
is as close to the float32 model as transformers running the same weights in bfloat16 is.

"Within bfloat16's tolerance" is measured, not guessed: both are compared to transformers in float32 along
the same tokens (float32's greedy continuation, as long as ours follows it), and our largest logprob error
must stay within a small multiple of transformers' own bfloat16 error."""

from __future__ import annotations

import pytest
import torch

from flotilla.engine.core.sampling_params import SamplingParams

from .test_hf_parity import MAX_TOKENS, TOP, hf_reference, make_engine, prompts


def teacher_forced_logprobs(model, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """The model's logprobs after the prompt and after each continuation token but the last."""
    ids = torch.tensor([prompt + continuation[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return list(torch.log_softmax(logits, dim=-1))


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-mqa-tied-headdim", "qwen2-bias-tied", "mistral"])
def test_bfloat16_stays_within_transformers_own_bfloat16_error(hf_models, arch):
    import copy

    folder, model = hf_models(arch)
    half = copy.deepcopy(model).to(torch.bfloat16)
    engine = make_engine(folder, dtype="bfloat16")
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert engine.runner.backend.name == "cpu"  # the compiled kernel reads bfloat16 caches
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    batch = prompts(seed=4)
    results = engine.generate(batch, params, use_tqdm=False)
    ours_worst = theirs_worst = 0.0
    followed = 0
    for prompt, result in zip(batch, results, strict=True):
        ref_tokens, ref_logprobs = hf_reference(model, prompt)
        theirs = teacher_forced_logprobs(half, prompt, ref_tokens)
        assert result.all_logprobs is not None
        # Compare while ours follows float32's greedy path (a near-tie may fork it; then both diverge).
        steps = 0
        while steps < MAX_TOKENS and result.token_ids[steps] == ref_tokens[steps]:
            steps += 1
        followed += steps
        for step in range(min(steps + 1, MAX_TOKENS)):
            ours = result.all_logprobs[step]
            for token, lp in ours.top:
                ours_worst = max(ours_worst, abs(lp - float(ref_logprobs[step][token])))
                theirs_worst = max(theirs_worst, abs(float(theirs[step][token] - ref_logprobs[step][token])))
    print(f"{arch}: ours {ours_worst:.4f}, transformers bf16 {theirs_worst:.4f}, followed {followed}")
    assert followed >= len(batch) * MAX_TOKENS // 2
    assert ours_worst <= 2 * theirs_worst + 0.02, (ours_worst, theirs_worst)
