"""The OpenAI wire schemas the gateway speaks (requests validated here, responses built here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Not OpenAI's, but what vLLM and others accept; useful to users of open models.
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # msgspec allows one array type per union: a list of strings or of token ids, checked later.
    prompt: str | list[str | int]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: str | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class AssistantMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
