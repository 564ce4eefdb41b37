"""The OpenAI wire schemas the gateway speaks (requests validated here, responses built here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

# Litestar copies a bound into the OpenAPI document only if the bound is truthy, so every
# lower bound of 0 vanished and the document allowed what the server refuses (temperature
# -1). What msgspec's `extra_json_schema["extra"]` holds reaches the document as it is:
# these repeat the zero bounds there. Keep them in step with the Meta bounds.
_MIN_0: dict[str, Any] = {"extra": {"minimum": 0}}
_ABOVE_0: dict[str, Any] = {"extra": {"exclusiveMinimum": 0}}

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, extra_json_schema=_MIN_0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0, extra_json_schema=_MIN_0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
# OpenAI clients know only these; an aborted or failed generation still ends as "stop".
FinishReason = Literal["stop", "length", "tool_calls"]
# OpenAI's rule for function and schema names.
Name = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
# OpenAI's `user`: the caller's id of its end user, stored on the request's usage event (and
# in the usage export). OpenAI publishes no limit; this one fits the ledger's column.
EndUser = Annotated[str, Meta(max_length=256)]
# The tiers a chat completion runs at (what a response reports): `flex` at batch priority.
ServiceTier = Literal["default", "flex"]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


# --- tools and structured outputs ----------------------------------------------------------


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct):
    """A call the model made (in a response, or sent back in an assistant message)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ToolCallDelta(msgspec.Struct):
    """A streamed tool call. Tokenmill sends each call whole, in one chunk."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Name
    description: str | None = None
    schema: dict[str, Any] | None = None  # absent: any JSON value
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: PositiveInt = 1  # at most TOKENMILL_MAX_N (tokenmill.request_limits)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: EndUser | None = None
    # Not OpenAI's, but what vLLM and others accept; useful to users of open models.
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0, extra_json_schema=_ABOVE_0)] | None = None
    ignore_eos: bool = False
    # Structured outputs by vLLM's names (one at most, and not with response_format): a JSON
    # schema, a regex the whole output matches, one of some strings, or a Lark grammar
    # (llguidance's dialect).
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, extra_json_schema=_MIN_0)] | None = None  # ≤ MAX_TOP_LOGPROBS
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # auto | default | flex (batch priority); any other tier is refused by name with the ones
    # that exist (tokenmill.request_limits.service_tier), so typed as a plain string.
    service_tier: str | None = None
    # Accepted and ignored (`IGNORED_CHAT` at the end says why, one by one). Typed as OpenAI
    # types them, so a value OpenAI would refuse is refused here too; open objects stay open.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    # A text, texts, token ids, or lists of token ids (several prompts, each its own choices).
    # msgspec allows one array type per union, so the items' sameness is checked later.
    prompt: str | list[str | int | list[int]]
    echo: bool = False  # each choice's text starts with its prompt's
    logprobs: Annotated[int, Meta(ge=0, le=5, extra_json_schema=_MIN_0)] | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None  # only as many as `n` (tokenmill.openai_shapes)


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


# --- log probabilities, as OpenAI shapes them --------------------------------------------------


class TopLogprob(msgspec.Struct):
    """One of the likeliest tokens at a position (chat completions)."""

    token: str
    logprob: float
    bytes: list[int] | None  # the token's own bytes: tokens may split a character


class ChatTokenLogprob(msgspec.Struct):
    """A generated token of a chat completion, with the likeliest ones at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]  # `top_logprobs` of them, best first (none when 0)


class ChatLogprobs(msgspec.Struct):
    """`choices[].logprobs` of a chat completion (of a chunk: its own tokens')."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None  # open models do not refuse apart from text


class CompletionLogprobs(msgspec.Struct):
    """`choices[].logprobs` of a text completion (of a chunk: its own tokens'), one entry per
    generated token in each list."""

    tokens: list[str]
    token_logprobs: list[float]
    # The `logprobs` likeliest tokens and the sampled one, text -> logprob.
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token starts in the choice's text, in characters


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    service_tier: ServiceTier = "default"  # the tier the request ran at


class Delta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: ServiceTier = "default"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The body of every error answer (tokenmill.errors builds it), as OpenAI shapes it."""

    error: ErrorDetail


# --- embeddings ---------------------------------------------------------------------------

# A text, texts, or already tokenized input (a list of token ids, or lists of them). msgspec
# allows one array type in a union, so the inner union is checked for sameness afterwards.
EmbeddingInput = str | list[str | int | list[int]]


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: EndUser | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 when asked for
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


# --- what each endpoint accepts -------------------------------------------------------------
#
# Request bodies refuse names they do not declare (`forbid_unknown_fields`): the gateway answers
# `400 Unrecognized request argument supplied: <name>`, as OpenAI does, so a misspelt or
# unsupported option is never silently dropped. An endpoint's struct declares OpenAI's
# parameters of that endpoint (acted on, refused by value with a specific message, or accepted
# and ignored) and the vLLM-style extensions; OpenAI's parameters refused whatever their value
# are left out of it and answered by name. Nested objects (messages, tools, ...) stay lenient:
# OpenAI's own responses, sent back as history, carry fields (refusal, annotations, ...) that
# mean nothing here. The README's "OpenAI compatibility" says the same for users.

# The vLLM-style parameters chat and text completions accept beside OpenAI's (`_Sampling`).
EXTENSIONS: tuple[str, ...] = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

# OpenAI parameters accepted and ignored, with why.
IGNORED_CHAT: dict[str, str] = {
    "store": "Tokenmill keeps no completions for distillation or evals; usage is metered either way.",
    "metadata": "Tags for stored completions (`store`); nothing is stored.",
    "prompt_cache_key": "Prefix caching needs no key: every prompt goes to the worker holding its "
    "longest cached prefix, within the organisation's own cache.",
    "prompt_cache_retention": "Cached prefixes stay while the engine's memory holds them (least "
    "recently used out); there is no retention to choose.",
    "prompt_cache_options": "Caching is automatic on every block of the prompt; there are no "
    "breakpoints or lifetimes to set.",
    "safety_identifier": "For OpenAI's abuse detection; Tokenmill runs none.",
    "reasoning_effort": "For OpenAI's reasoning models; an open model's template decides whether "
    "and how long it reasons.",
    "verbosity": "A hint to OpenAI's GPT-5 models; open models have no such control.",
    "modalities": "Text is the only output; a request asking for audio gets text, as from a "
    "model without audio.",
    "audio": "Settings of audio output, which no model here produces.",
    "prediction": "Predicted outputs only make OpenAI answer faster, never differently; the "
    "answer here is the same without them.",
    "web_search_options": "No web search runs here; the model answers from what it knows.",
}

# OpenAI parameters refused whatever their value, with the message that says so. Not declared
# (so not in the API document either), they are answered by name rather than as unrecognized.
_FUNCTIONS = (
    "'functions' and 'function_call' (deprecated by OpenAI) are not supported; use 'tools' and 'tool_choice'."
)
REFUSED_CHAT: dict[str, str] = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "moderation": "Moderation is not available on this server: 'moderation' is not supported.",
}


class Parameters(NamedTuple):
    """Beyond OpenAI's own parameters, what one endpoint's request body accepts or refuses."""

    ignored: Mapping[str, str]  # accepted and not acted on -> why
    extensions: tuple[str, ...]  # accepted though not OpenAI's
    refused: Mapping[str, str]  # OpenAI's, refused whatever the value -> the message


PARAMETERS: dict[type[msgspec.Struct], Parameters] = {
    ChatCompletionRequest: Parameters(IGNORED_CHAT, EXTENSIONS, REFUSED_CHAT),
    CompletionRequest: Parameters({}, EXTENSIONS, {}),
    EmbeddingRequest: Parameters({}, (), {}),
}
