"""What the engine hands back each step, per request: the new tokens and text, and, when it finishes,
the reason and the whole output. Also the engine-wide counters a server exports as metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# What the sampler gives per token when logprobs are asked for: (the token's logprob, the top ones).
SampledLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this step, (token id, logprob), most likely first; empty unless asked.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    # Filled in when finished: the whole generated text and tokens (stop string removed).
    text: str | None = None
    token_ids: list[int] | None = None
    all_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class TenantStats:
    """One tenant's share of the engine, from the scheduler's fair-share ledger (core/fair_share.py)."""

    counter: float = 0.0  # the virtual token counter: weighted tokens served / the tenant's weight
    prompt_tokens: int = 0  # since start
    generation_tokens: int = 0  # since start
    num_waiting: int = 0  # requests of the tenant queued now


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start, as vLLM counts them: one draft per request and step
    that verified drafts, the draft tokens verified, those accepted, and accepted tokens per draft position
    (the acceptance at position i is accepted_per_position[i] / num_drafts)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the one the target always adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )


@dataclass
class EngineStats:
    """Monotonic counters (the server turns them into Prometheus counters) plus the latest gauges."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used KV blocks / all KV blocks
    num_steps: int = 0
    # Per request tenant ("" is the engine's own when none was named), in the order tenants first arrived.
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # LoRA: per loaded adapter, what it has served; the adapters running and waiting; the slots.
    loras: dict[str, LoRAStats] = field(default_factory=dict)
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    max_loras: int = 0


@dataclass
class LoRAStats:
    """What one loaded adapter has served since it was loaded."""

    requests: int = 0  # finished (not aborted)
    prompt_tokens: int = 0  # of its finished requests
    generation_tokens: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is: its float dtype, the weight-only quantization of its decoder's linear
    layers (model/quantize.py) and the bytes its weights take. Fixed once loaded."""

    dtype: str  # the float layers' (embeddings, norms, LM head), e.g. "float32"
    quantization: str = "none"  # none | int8 | int4
    quantization_group_size: int | None = None  # int4 only
    weight_bytes: int = 0  # parameters and persistent buffers, quantized weights and their scales included
    bf16_weight_bytes: int = 0  # the same weights at 2 bytes per element (a quantized layer: out x in)
    kernels: dict[str, int] = field(default_factory=dict)  # what computes the quantized layers -> layers

    def describe(self) -> str:
        """One line for logs and benchmark output."""
        method = self.quantization
        if self.quantization_group_size is not None:
            method += f" (group size {self.quantization_group_size})"
        line = f"{method}, {self.dtype} float layers, weights {self.weight_bytes / 2**20:.1f} MiB"
        if self.bf16_weight_bytes:
            line += f" ({self.weight_bytes / self.bf16_weight_bytes:.2f}x of bfloat16)"
        if self.kernels:
            line += "; quantized layers on " + ", ".join(
                f"{k} ({n})" for k, n in sorted(self.kernels.items())
            )
        return line
