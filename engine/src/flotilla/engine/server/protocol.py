"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests ignore fields they do not know (clients send many), but fields we know and cannot honour are
refused by the server with a 400 rather than silently dropped. Range rules live here too, so the
OpenAPI schema (and the fuzzer that reads it) knows them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # most choices one request may ask for (n times the number of prompts)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """The fields both generation endpoints share."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known but not supported: refused when set to anything but their neutral value.
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# -- responses ------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flotilla"
    # vLLM's: a LoRA adapter's parent is the base model's id, its root the folder it was loaded from; the
    # base model is its own root and has no parent.
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    quantization: str = "none"  # the decoder's weight-only quantization: none, int8 or int4
    quantization_group_size: int | None = None  # int4 only
    weight_bytes: int  # the loaded weights, quantized weights and their scales included


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; its lora_int_id is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str
