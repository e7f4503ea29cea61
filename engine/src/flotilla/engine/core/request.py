"""A request's state as the scheduler and block manager see it: tokens, progress, and its KV blocks.

No torch here: the scheduler and the block manager are plain Python.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from flotilla.contract import root_block_hash
from flotilla.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away


_arrival_counter = itertools.count()


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Lower values are served first; FCFS among equals.
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    # Who the request is served for: the gateway's trusted header, else the engine's own tenant.
    tenant: str = ""
    # The LoRA adapter it runs with (lora/); None: the base model.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt has no tokens")
        # Tie-breaker that keeps FCFS order even when arrival times are equal.
        self.arrival_index = next(_arrival_counter)
        self.output_token_ids: list[int] = []
        # all_token_ids = prompt + outputs; KV exists for the first num_computed_tokens of them.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Speculative decoding: the tokens proposed for the next step (verified there, never cached before),
        # and how many of all_token_ids have KV in the draft model's cache.
        self.spec_token_ids: list[int] = []
        self.num_draft_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_ids: list[int] = []
        # Chained hashes of the full blocks of all_token_ids, filled in lazily.
        self.block_hashes: list[int] = []
        # Where the chain of block hashes starts: one root per adapter, so that KV computed with one
        # adapter's weights is never shared with another's requests.
        self.hash_root = root_block_hash(self.lora_name)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """All known tokens but the last have KV: the next step computes one token (plus any drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops the output tokens after the first num_output_tokens (a stop string ended the text there,
        inside a step that appended several)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
