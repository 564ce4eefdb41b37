"""The wire schemas of OpenAI's Responses API (`/v1/responses`): the request validated here,
the Response object, its items and its stream events built here.

Shaped field for field as the official `openai` SDK reads them (`openai.types.responses`).
The gateway answers a Responses request through its chat completion path
(gateway/response_shapes.py translates both ways), so only what differs lives here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tokenmill.openai_types import EndUser, Parameters, PositiveInt, Probability, Temperature

# --- the request --------------------------------------------------------------------------


class TextConfig(msgspec.Struct, kw_only=True):
    """`text`: the output's format (`{"type": "text" | "json_object" | "json_schema", ...}`,
    read by gateway/response_shapes.py) and OpenAI's verbosity hint (ignored)."""

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses`. Items, tools and formats stay open objects here and are checked
    one by one (a 400 naming e.g. `input[2].content[0]`), as Responses items are a union
    whose `type` may be left out."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # left out: true, as OpenAI
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # kept on the response and answered back
    user: EndUser | None = None
    service_tier: str | None = None  # as chat completions take it
    # Refused by value with their own message (gateway/response_shapes.py): background true,
    # truncation "auto", top_logprobs above 0, include of output logprobs (else ignored).
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # The lower bound repeated for the API document (tokenmill.openai_types says why).
    top_logprobs: Annotated[int, Meta(ge=0, le=20, extra_json_schema={"extra": {"minimum": 0}})] | None = None
    include: list[str] | None = None
    # Accepted and ignored (`IGNORED_RESPONSES` says why).
    reasoning: dict[str, Any] | None = None
    max_tool_calls: PositiveInt | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None


IGNORED_RESPONSES: dict[str, str] = {
    "reasoning": "For OpenAI's reasoning models; an open model's template decides whether and how "
    "long it reasons, and no reasoning items are produced.",
    "max_tool_calls": "Counts calls to OpenAI's built-in tools, none of which run here.",
    "stream_options": "Its one option, `include_obfuscation`, pads events against a side channel of "
    "OpenAI's; events here carry no padding.",
    "prompt_cache_key": "Prefix caching needs no key: every prompt goes to the worker holding its "
    "longest cached prefix, within the organisation's own cache.",
    "prompt_cache_retention": "Cached prefixes stay while the engine's memory holds them.",
    "prompt_cache_options": "Caching is automatic on every block of the prompt.",
    "safety_identifier": "For OpenAI's abuse detection; Tokenmill runs none.",
    "include": "Asks for extra output of OpenAI's hosted tools and reasoning, none of which exist "
    "here (output logprobs, the one that could, are refused for now).",
    "image": "Settings of image inputs, which no model here takes.",
    "access_programs": "OpenAI's access programs do not exist here.",
}

REFUSED_RESPONSES: dict[str, str] = {
    "conversation": "The Conversations API is not available on this server: 'conversation' is not "
    "supported; continue a conversation with 'previous_response_id'.",
    "prompt": "Stored prompt templates are not available on this server: 'prompt' is not supported; "
    "send 'instructions' and 'input'.",
    "background_options": "Background responses are not supported: 'background_options' is not supported.",
    "context_management": "Server-side compaction is not available: 'context_management' is not supported.",
    "moderation": "Moderation is not available on this server: 'moderation' is not supported.",
}

RESPONSES_PARAMETERS = Parameters(IGNORED_RESPONSES, (), REFUSED_RESPONSES)


# --- the Response object ------------------------------------------------------------------


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list[dict[str, Any]] = msgspec.field(default_factory=list)
    logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # OpenAI counts what explicit cache breakpoints wrote; caching here is implicit and writes
    # cost nothing, so none are counted.
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class Reasoning(msgspec.Struct):
    effort: None = None
    summary: None = None


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    service_tier: str
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int = 0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
    background: bool = False
    max_tool_calls: int | None
    prompt_cache_key: str | None
    safety_identifier: str | None


class ResponseItemList(msgspec.Struct):
    """`GET /v1/responses/{id}/input_items`: a cursor page of the conversation's items."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class DeletedResponse(msgspec.Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# --- stream events ------------------------------------------------------------------------
#
# Server-sent events `event: <type>` / `data: <the event as JSON>`, numbered from 0 in
# `sequence_number`. `type` is a plain field (one struct serves several types).


class LifecycleEvent(msgspec.Struct):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class TextDoneEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ArgumentsDeltaEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(msgspec.Struct):
    type: str
    sequence_number: int
    code: str | None
    message: str
    param: str | None
