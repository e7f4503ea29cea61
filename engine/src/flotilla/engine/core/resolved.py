"""What the engine settled on when its model loaded, and the one prompt-length check. No torch.

The flags leave some values open (`--max-model-len`, `--dtype auto`, `--device auto`, the KV cache's
size); the model runner decides them from the flags, the model's config.json and the device, once, when
it loads, and puts them in a frozen `Resolved`. The runner itself, the engine, the scheduler and the
server read them from there (`LLMEngine.resolved`, `AsyncEngine.resolved`), never from the runner's
insides.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.engine.core.outputs import ModelInfo


@dataclass(frozen=True)
class Resolved:
    # Tokens one sequence may hold, prompt and output: --max-model-len or the model's positions, within its
    # sliding window, and lowered to what the KV cache holds.
    max_model_len: int
    num_blocks: int  # KV blocks the pool hands out (the runner's cache has one scratch block more)
    block_size: int  # tokens per KV block
    prefix_caching: bool
    dtype: str  # the float dtype the model and its KV cache run in, e.g. "float32"
    device: str  # e.g. "cpu", "cuda"
    vocab_size: int
    model_info: ModelInfo  # the loaded weights: quantization, sizes, kernels

    def check_prompt(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None = None,
        *,
        prompt_field: str = "prompt",
        max_tokens_field: str = "max_tokens",
    ) -> None:
        check_context_length(
            num_prompt_tokens,
            self.max_model_len,
            max_tokens,
            prompt_field=prompt_field,
            max_tokens_field=max_tokens_field,
        )


class ContextLengthError(ValueError):
    """A prompt (with the tokens it asks for) that does not fit the context; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(
    num_prompt_tokens: int,
    max_model_len: int,
    max_tokens: int | None = None,
    *,
    prompt_field: str = "prompt",
    max_tokens_field: str = "max_tokens",
) -> None:
    """The one prompt-length check, with its one wording (the server's 400, the engine's and the
    scheduler's ValueError): a prompt must leave room for at least one generated token, and for
    `max_tokens` when it is given. The error names the field to blame, its value and the limit."""
    n = num_prompt_tokens
    if n >= max_model_len:  # the prompt alone is too long, whatever max_tokens says
        field, value, generate = prompt_field, f"{n} tokens", 1
    elif max_tokens is not None and n + max_tokens > max_model_len:
        field, value, generate = max_tokens_field, str(max_tokens), max_tokens
    else:
        return
    raise ContextLengthError(
        f"'{field}' is {value}: {n} prompt tokens and {generate} to generate make {n + generate} tokens, "
        f"more than the context length of {max_model_len}",
        field,
    )
