"""The wire schemas of OpenAI's Batch API (`/v1/batches`), field for field as the official
`openai` SDK reads them (`openai.types.Batch`, its cursor page), and the lines of a batch's
input, output and error files (OpenAI's batch file formats)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# What a batch's lines may call: the generation and embedding endpoints served here.
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BATCH_ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchCreateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input_file_id: str
    endpoint: str  # checked by the service, so a wrong one gets OpenAI's words, not a schema error
    completion_window: str
    metadata: dict[str, str] | None = None


class BatchError(msgspec.Struct, omit_defaults=True):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchError]
    object: Literal["list"] = "list"


class BatchRequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(msgspec.Struct, kw_only=True):
    id: str  # batch_...
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int  # Unix seconds, as every *_at
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    model: str | None = None
    metadata: dict[str, str] | None = None


class BatchList(msgspec.Struct):
    """`GET /v1/batches`: a cursor page (the next one starts `after` the last id)."""

    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class BatchInputLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a batch's input file."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: Any


class BatchLineError(msgspec.Struct):
    code: str
    message: str


class BatchOutputLine(msgspec.Struct):
    """One line of a batch's output file (a 2xx answer) or error file (any other answer, with
    `response`; or a line that never ran, with `error`)."""

    id: str  # batch_req_...
    custom_id: str | None
    response: BatchResponse | None
    error: BatchLineError | None
