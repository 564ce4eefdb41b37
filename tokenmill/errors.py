"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every app of ours installs `exception_handlers()`, so no request ever ends in a traceback.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger("tokenmill.errors")

# msgspec names the offending field as "- at `$.messages[0].role`" or "field `messages`".
_FIELD = re.compile(r"(?:at `\$\.|field `)([\w.\[\]]+)`")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "api_error")
        self.headers = headers or {}
        # What kind of refusal this is, for the gateway's accounting (gateway/metrics.py's
        # REASONS), where the code and type do not tell (every 429 of the limits is
        # `rate_limit_exceeded`); None: told by them.
        self.reason = reason
        # Set when a worker ran the request (gateway/services.py): it is metered, and counted
        # with the answered requests, so it is no refusal.
        self.metered = False

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _api_error(_: Request, exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers)


def _validation(_: Request, exc: ValidationException) -> Response:
    message = exc.detail or "Invalid request"
    param = None
    extra = exc.extra if isinstance(exc.extra, list) else []
    if extra and isinstance(extra[0], dict):
        message = str(extra[0].get("message") or message)
        param = extra[0].get("key") or None
        if param == "data" and message == "'data'":
            # An empty body: Litestar reports the KeyError of the missing value, "'data'".
            message = "The request body is empty; send a JSON object."
            return Response(error_body(message, "invalid_request_error", None, None), status_code=400)
    if param in (None, "data"):  # the body as a whole: name the field msgspec complained of
        found = _FIELD.search(message)
        param = found.group(1) if found else None
    if param:
        message = f"Invalid value for '{param}': {message}"
    return Response(error_body(message, "invalid_request_error", None, param), status_code=400)


def _http(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    code = {404: "not_found", 405: "method_not_allowed", 401: "invalid_api_key"}.get(status)
    return Response(
        error_body(exc.detail, _TYPES.get(status, "api_error"), code),
        status_code=status,
        headers=exc.headers,
    )


def _internal(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return Response(
        error_body(
            "The server had an error while processing your request.", "server_error", "internal_error"
        ),
        status_code=500,
    )


def exception_handlers() -> dict[Any, Any]:
    return {
        APIError: _api_error,
        ValidationException: _validation,
        HTTPException: _http,
        Exception: _internal,
    }
