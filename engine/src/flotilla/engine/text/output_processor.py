"""Output processing, apart from the step loop (as vLLM v1 does): turns each step's sampled tokens into
RequestOutputs.

Per request it keeps an incremental detokenizer, finds stop strings (truncating the text at the first
one), holds back text that could be the start of a stop string, and hands out only what is new since
the last output. It also counts tokens and finish reasons for the engine's stats.

It never touches the scheduler: a request a stop string ends comes back in `stopped`, and the engine
finishes it there (so its KV blocks are freed). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flotilla.engine.core.outputs import RequestOutput, SampledLogprob, TokenLogprob
from flotilla.engine.core.request import FinishReason, Request
from flotilla.engine.text.detokenizer import IncrementalDetokenizer
from flotilla.engine.text.tokenizer import ModelTokenizer


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    # Ids of requests a stop string finished; the scheduler still holds them until the engine finishes them.
    stopped: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # Counters since start, read by LLMEngine.stats().
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        logprobs = [] if params.logprobs is not None else None
        self._states[request.request_id] = _RequestState(detokenizer, logprobs=logprobs)

    def abort(self, request_id: str, was_unfinished: bool) -> None:
        """Drops the request's state. Counts an abort only when the scheduler still had the request, so
        aborting a finished (or unknown) request twice counts nothing."""
        self._states.pop(request_id, None)
        if was_unfinished:
            self._count_finish(FinishReason.ABORT)

    def process(
        self, sampled: Sequence[tuple[Request, list[int], SampledLogprob | None]], now: float
    ) -> ProcessedOutputs:
        """One step's tokens per request (one, or several after verified drafts), each already appended
        to its request, with length/eos stops applied; logprobs come only with a single token."""
        processed = ProcessedOutputs()
        for request, tokens, logprob in sampled:
            output, stopped = self._process_tokens(request, tokens, logprob, now)
            processed.outputs.append(output)
            if stopped:
                processed.stopped.append(request.request_id)
        return processed

    def _process_tokens(
        self, request: Request, tokens: list[int], logprob: SampledLogprob | None, now: float
    ) -> tuple[RequestOutput, bool]:
        state = self._states[request.request_id]
        first_output = request.num_output_tokens - len(tokens)
        stopped = False
        for i, token in enumerate(tokens):
            self._record_token(request, state, token, logprob, now)
            last = i == len(tokens) - 1
            stopped = self._detokenize(request, state, token, first_output + i + 1, last)
            if stopped and not last:
                # A stop string ended the text inside this step's tokens: the ones after it were never output.
                request.truncate_output(first_output + i + 1)
                break
        finished = request.is_finished or stopped
        reason = FinishReason.STOP if stopped else request.finish_reason
        output = self._delta(request, state, finished, reason)
        if finished:
            output.text = state.detokenizer.text
            output.token_ids = list(request.output_token_ids)
            output.all_logprobs = state.logprobs
            self._states.pop(request.request_id, None)
            self._count_finish(reason)
        return output, stopped

    def _record_token(
        self,
        request: Request,
        state: _RequestState,
        token: int,
        logprob: SampledLogprob | None,
        now: float,
    ) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            self.prompt_tokens += request.num_prompt_tokens
        request.last_token_time = now
        self.generation_tokens += 1
        if logprob is not None and state.logprobs is not None:
            state.logprobs.append(TokenLogprob(token, logprob[0], logprob[1]))

    def _detokenize(
        self, request: Request, state: _RequestState, token: int, num_output_tokens: int, last: bool
    ) -> bool:
        """Adds the token's text (the request's num_output_tokens-th); True when a stop string ends the
        request (the text is cut before it)."""
        params = request.sampling_params
        detok = state.detokenizer
        detok.add(token)
        ended = request.is_finished and last
        if params.stop and not ended and num_output_tokens >= params.min_tokens:
            # Only the tail can hold a new match: what was emitted was already searched.
            window = len(detok.text) - (max(map(len, params.stop)) + 8)
            hit = find_stop(detok.text, params.stop, max(window, state.emitted_chars, 0))
            if hit is not None:
                detok.text = detok.text[:hit]
                return True
        elif ended:
            detok.flush()
        return False

    def _delta(
        self, request: Request, state: _RequestState, finished: bool, reason: FinishReason | None
    ) -> RequestOutput:
        """The output with what is new since the last one."""
        params = request.sampling_params
        text = state.detokenizer.text
        limit = len(text)
        if params.stop and not finished:
            # Hold back what could be the start of a stop string.
            limit = max(state.emitted_chars, limit - (max(map(len, params.stop)) - 1))
        new_text = text[state.emitted_chars : limit]
        state.emitted_chars = limit
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        state.num_emitted_tokens = request.num_output_tokens
        new_logprobs = None
        if state.logprobs is not None:
            new_logprobs = state.logprobs[-len(new_ids) :] if new_ids else []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=reason.value if finished and reason else None,
            logprobs=new_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            last_token_time=request.last_token_time,
        )

    def _count_finish(self, reason: FinishReason | None) -> None:
        key = reason.value if reason else "unknown"
        self.finished_by_reason[key] = self.finished_by_reason.get(key, 0) + 1


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest of `stops` begins in text[start:], or None."""
    best = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
