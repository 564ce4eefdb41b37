"""The lines of a batch: each input line checked as its endpoint would check it, each result
made into a line of the output or error file (OpenAI's batch file formats), and the request id a
line runs under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from tokenmill.openai_batches import BatchInputLine, BatchLineError, BatchOutputLine, BatchResponse
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

# The output tokens a line without `max_tokens` is assumed to use, in its queue estimate.
DEFAULT_OUTPUT_ESTIMATE = 1024
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."

_BODIES: dict[str, type[Any]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
_line = msgspec.json.Decoder(BatchInputLine)
_encode = msgspec.json.Encoder()


def line_request_id(batch_id: str, line: int) -> str:
    """The request id of a batch's line, the same every time it runs: the ledger inserts one
    usage event per request id, so a line re-run after a crash is metered once. `req_` like
    every request id (the answer's own id is derived from what follows it)."""
    return f"req_{batch_id}-{line}"


def result_line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    *,
    status: int | None = None,
    body: Any = None,
    code: str | None = None,
    message: str | None = None,
) -> str:
    """A line of the output or error file: an answer (`status`, `body`), or an error of a line
    that did not run (`code`, `message`)."""
    rid = line_request_id(batch_id, line)
    out = BatchOutputLine(
        id=f"batch_req_{rid.removeprefix('req_batch_')}",
        custom_id=custom_id,
        response=None if status is None else BatchResponse(status, rid, body),
        error=None if code is None else BatchLineError(code, message or ""),
    )
    return _encode.encode(out).decode()


@dataclass(slots=True)
class Checked:
    """What validation made of one line of the input file."""

    line: int
    custom_id: str | None
    body: str | None = None  # the request to send, when valid
    model: str | None = None
    tokens: int = 0  # its estimate toward the batch queue limit
    code: str | None = None  # why it is invalid
    message: str | None = None


def check_line(endpoint: str, line: int, raw: bytes) -> Checked:
    """One input line, checked as the batch's endpoint would check it (its body against the
    request schema too), so a line that cannot run never reaches the gateway."""
    try:
        item = _line.decode(raw)
    except msgspec.DecodeError as exc:
        custom_id = None
        try:
            loose = msgspec.json.decode(raw)
            if isinstance(loose, dict) and isinstance(loose.get("custom_id"), str):
                custom_id = loose["custom_id"]
        except msgspec.DecodeError:
            return Checked(line, None, code="invalid_json_line", message=f"Line {line} is not valid JSON.")
        return Checked(line, custom_id, code="invalid_request", message=f"Line {line}: {exc}")
    if not item.custom_id:
        return Checked(line, item.custom_id, code="invalid_request", message="custom_id must not be empty.")
    if item.method.upper() != "POST":
        return Checked(
            line, item.custom_id, code="invalid_method", message="Only the POST method is supported."
        )
    if item.url != endpoint:
        return Checked(
            line,
            item.custom_id,
            code="mismatched_endpoint",
            message=f"The line's url '{item.url}' is not the batch's endpoint '{endpoint}'.",
        )
    if item.body.get("stream"):
        return Checked(line, item.custom_id, code="invalid_request", message="Batch requests cannot stream.")
    try:
        request = msgspec.convert(item.body, _BODIES[endpoint])
    except msgspec.ValidationError as exc:
        return Checked(line, item.custom_id, code="invalid_request", message=f"Invalid body: {exc}")
    body = _encode.encode(item.body).decode()
    return Checked(line, item.custom_id, body, request.model, _estimate(request, len(body)))


def _estimate(request: Any, size: int) -> int:
    """A line's tokens for the queue limit, without a tokenizer: its body at ~4 bytes a token,
    plus the output it may generate."""
    if isinstance(request, EmbeddingRequest):
        return size // 4 + 1
    out = getattr(request, "max_completion_tokens", None) or request.max_tokens or DEFAULT_OUTPUT_ESTIMATE
    return size // 4 + 1 + out * max(1, getattr(request, "n", 1) or 1)
