"""Per-request generation settings, validated up front so bad input fails with a clear message."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    # temperature 0 means greedy decoding.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; 0: the sampled token's logprob; k>0: also the k most likely tokens.
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise ValueError(f"sampling parameter {name}={getattr(self, name)!r}: {rule}")

        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def speculation_opt_out(self) -> str | None:
        """Why speculative decoding cannot serve this request (it then decodes one token per step), or
        None. Logprobs would have to be those of the processed target distribution at every accepted
        position, and penalties change with every accepted token; neither is done here."""
        if self.logprobs is not None:
            return "logprobs"
        if self.has_penalties:
            return "penalties"
        return None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
