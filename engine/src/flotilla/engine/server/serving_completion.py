"""POST /v1/completions, past its route: prompts (text or token ids) in, text completions out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Response

from flotilla.engine.core.outputs import TokenLogprob
from flotilla.engine.server.errors import bad_request
from flotilla.engine.server.protocol import CompletionRequest
from flotilla.engine.server.serving import SSE_DONE, Call, Job, OpenAIServing

OBJECT = "text_completion"


class ServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, req: CompletionRequest, call: Call) -> Response:
        """Checks the request once (400s), submits it, and answers in JSON or SSE as it asked."""
        if req.echo:
            raise bad_request("'echo' is not supported", param="echo")
        if req.suffix:
            raise bad_request("'suffix' is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("'best_of' is not supported (use n)", param="best_of")
        job = self._job(
            req,
            call,
            self._prompt_ids(req.prompt),
            prompt_field="prompt",
            max_tokens=req.max_tokens,
            max_tokens_field="max_tokens",
            logprobs=req.logprobs,
        )
        return await self._respond(
            job, call, lambda: self._answer(job, req.logprobs), lambda: self._events(job, req.logprobs)
        )

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        vocab_size = self.resolved.vocab_size
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise bad_request(
                    f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})", param="prompt"
                )
            if not ids:
                raise bad_request("the prompt has no tokens", param="prompt")
            out.append(ids)
        return out

    async def _answer(self, job: Job, logprobs: int | None) -> dict:
        await self._run_to_end(job)
        choices = []
        for c in job.choices:
            entry = {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            if logprobs is not None:
                entry["logprobs"] = self._logprobs(c.logprobs, logprobs > 0)
            choices.append(entry)
        return self._body(job, OBJECT, choices)

    async def _events(self, job: Job, logprobs: int | None) -> AsyncIterator[str]:
        offsets = dict.fromkeys(range(len(job.choices)), 0)
        failed = False
        async for part in self._guarded(self._run(job)):
            if isinstance(part, str):
                failed = True
                yield part
                continue
            choice, out = part
            if not (out.new_text or out.finished or (logprobs is not None and out.logprobs)):
                continue
            entry = {"index": choice.index, "text": out.new_text, "logprobs": None, "finish_reason": None}
            if logprobs is not None:
                entry["logprobs"] = self._logprobs(out.logprobs or [], logprobs > 0, offsets[choice.index])
                offsets[choice.index] += len(out.new_text)
            if out.finished:
                entry["finish_reason"] = out.finish_reason
            yield self._chunk(job, OBJECT, [entry])
        if job.include_usage and not failed:
            yield self._chunk(job, OBJECT, [], self._usage(job))
        yield SSE_DONE

    def _logprobs(self, logprobs: list[TokenLogprob], want_top: bool, offset: int = 0) -> dict:
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs]
            if want_top
            else None,
            "text_offset": offsets,
        }
