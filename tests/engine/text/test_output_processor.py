"""The output processor on its own: tokens are fed by hand (no model, no scheduler, no torch), as the
scheduler would append them, so each rule is checked token by token."""

from __future__ import annotations

import subprocess
import sys

from flotilla.engine.core.request import FinishReason, Request, RequestStatus
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.text.output_processor import OutputProcessor, find_stop


def feed(processor, request, tokens, finish_last_with=None, logprob=None):
    """Appends each token and processes it; returns the outputs and the ids the processor stopped."""
    outputs, stopped = [], []
    for i, token in enumerate(tokens):
        request.append_output_token(token)
        if finish_last_with is not None and i == len(tokens) - 1:
            request.status, request.finish_reason = RequestStatus.FINISHED, finish_last_with
        processed = processor.process([(request, [token], logprob)], now=100.0 + i)
        outputs += processed.outputs
        stopped += processed.stopped
        if processed.stopped:
            break
    return outputs, stopped


def make(tokenizer, request_id="r", **params):
    request = Request(request_id, tokenizer.encode("hi", add_special_tokens=False), SamplingParams(**params))
    processor = OutputProcessor(tokenizer)
    processor.add_request(request)
    return processor, request


def test_stop_string_cuts_the_text_and_held_back_deltas_add_up(byte_tokenizer):
    processor, request = make(byte_tokenizer, stop=["lo w"], max_tokens=50)
    outputs, stopped = feed(
        processor, request, byte_tokenizer.encode("hello world", add_special_tokens=False)
    )
    final = outputs[-1]
    assert stopped == ["r"] and final.finished and final.finish_reason == "stop"
    assert final.text == "hel" == "".join(o.new_text for o in outputs)
    # The last len("lo w") - 1 characters wait until they cannot begin the stop string.
    assert [o.new_text for o in outputs] == ["", "", "", "h", "e", "l", ""]
    assert processor.finished_by_reason == {"stop": 1}


def test_a_finish_by_the_scheduler_flushes_and_counts(byte_tokenizer):
    processor, request = make(byte_tokenizer, max_tokens=3)
    outputs, stopped = feed(
        processor, request, byte_tokenizer.encode("abc", add_special_tokens=False), FinishReason.LENGTH
    )
    assert stopped == [] and [o.new_text for o in outputs] == ["a", "b", "c"]
    final = outputs[-1]
    assert (
        final.finish_reason == "length"
        and final.text == "abc"
        and final.token_ids == request.output_token_ids
    )
    assert final.first_token_time == 100.0 and final.last_token_time == 102.0
    assert (processor.prompt_tokens, processor.generation_tokens) == (2, 3)


def test_logprobs_arrive_with_their_tokens(byte_tokenizer):
    processor, request = make(byte_tokenizer, max_tokens=2, logprobs=1)
    outputs, _ = feed(processor, request, [5, 6], FinishReason.LENGTH, logprob=(-0.5, [(5, -0.5)]))
    assert [len(o.logprobs) for o in outputs] == [1, 1]
    assert [lp.token_id for lp in outputs[-1].all_logprobs] == [5, 6]


def test_an_abort_counts_once(byte_tokenizer):
    processor, _ = make(byte_tokenizer)
    processor.abort("r", was_unfinished=True)
    processor.abort("r", was_unfinished=False)
    assert processor.finished_by_reason == {"abort": 1}


def test_find_stop_takes_the_earliest():
    assert find_stop("abcdef", ["de", "bc"], 0) == 1
    assert find_stop("abcdef", ["bc"], 2) is None


def test_the_output_processor_imports_no_torch():
    code = "import sys, flotilla.engine.text.output_processor; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
