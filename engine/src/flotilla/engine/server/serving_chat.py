"""POST /v1/chat/completions, past its route: messages through the model's chat template in, assistant
messages out. Its template is also what /tokenize applies to messages (`prompt_ids`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Response

from flotilla.engine.core.outputs import TokenLogprob
from flotilla.engine.server.errors import bad_request
from flotilla.engine.server.protocol import ChatCompletionRequest, ChatMessage
from flotilla.engine.server.serving import SSE_DONE, Call, Job, OpenAIServing
from flotilla.engine.text.tokenizer import plain_chat_messages

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


class ServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    async def create_chat_completion(self, req: ChatCompletionRequest, call: Call) -> Response:
        """Checks the request once (400s), submits it, and answers in JSON or SSE as it asked."""
        if req.tools:
            raise bad_request("'tools' are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only the 'text' response_format is supported", param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        ids = self.prompt_ids(req.messages, req.add_generation_prompt)
        max_tokens, max_tokens_field = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_field = req.max_completion_tokens, "max_completion_tokens"
        job = self._job(
            req,
            call,
            [ids],
            prompt_field="messages",
            max_tokens=max_tokens,
            max_tokens_field=max_tokens_field,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        return await self._respond(
            job, call, lambda: self._answer(job, req.logprobs), lambda: self._events(job, req.logprobs)
        )

    def prompt_ids(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """The messages through the chat template, as token ids (400 when there is no template, or it
        refuses or fails on these messages)."""
        plain = plain_chat_messages([m.model_dump() for m in messages])
        try:
            return self.tokenizer.encode_chat(plain, add_generation_prompt)
        except ValueError as exc:  # no chat template
            raise bad_request(str(exc), param="messages") from exc
        except Exception as exc:  # the template itself refused (raise_exception) or failed
            raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from exc

    async def _answer(self, job: Job, logprobs: bool) -> dict:
        await self._run_to_end(job)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": self._logprobs(c.logprobs) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in job.choices
        ]
        return self._body(job, OBJECT, choices)

    async def _events(self, job: Job, logprobs: bool) -> AsyncIterator[str]:
        def chunk(index: int, delta: dict, finish_reason: str | None = None, entry_logprobs=None) -> dict:
            return {
                "index": index,
                "delta": delta,
                "logprobs": entry_logprobs,
                "finish_reason": finish_reason,
            }

        roles = [chunk(c.index, {"role": "assistant", "content": ""}) for c in job.choices]
        yield self._chunk(job, CHUNK_OBJECT, roles)
        failed = False
        async for part in self._guarded(self._run(job)):
            if isinstance(part, str):
                failed = True
                yield part
                continue
            choice, out = part
            if out.new_text or (logprobs and out.logprobs):
                entry_logprobs = self._logprobs(out.logprobs or []) if logprobs else None
                yield self._chunk(
                    job, CHUNK_OBJECT, [chunk(choice.index, {"content": out.new_text}, None, entry_logprobs)]
                )
            if out.finished:
                yield self._chunk(job, CHUNK_OBJECT, [chunk(choice.index, {}, out.finish_reason)])
        if job.include_usage and not failed:
            yield self._chunk(job, CHUNK_OBJECT, [], self._usage(job))
        yield SSE_DONE

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }
