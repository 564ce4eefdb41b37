"""Internal HTTP endpoints, mounted at `/internal`, for traffic inside the deployment.

In the embedded mode there is no Redis: local workers publish heartbeats and KV events
to the server's in-memory bus through `POST /internal/bus/{stream}`. Every internal
endpoint requires the internal token, so nothing on the network can inject fleet state
or usage without it. A worker's own token (`TOKENMILL_WORKER_TOKEN`) is accepted too, for
what a worker says only (heartbeats and KV events): a worker cannot publish usage or key
changes.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath
from litestar.types import Guard

from tokenmill import protocol
from tokenmill.bodies import json_error
from tokenmill.bus import EventBus

# Streams a caller may publish to; anything else is a 404 so a typo or a probe cannot
# create arbitrary keys in the bus.
KNOWN_STREAMS = frozenset({protocol.WORKERS, protocol.KV, protocol.USAGE, protocol.KEYS})
# The scope of the worker token: what a worker publishes, nothing that is billed or trusted.
WORKER_STREAMS = frozenset({protocol.WORKERS, protocol.KV})


class InternalAPIError(HTTPException):
    """An error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status_code: int, message: str, code: str, type: str = "invalid_request_error"):
        super().__init__(detail=message, status_code=status_code)
        self.message = message
        self.code = code
        self.type = type


def error_response(request: Request[Any, Any, Any], exc: InternalAPIError) -> Response[dict[str, Any]]:
    body = {"error": {"message": exc.message, "type": exc.type, "param": None, "code": exc.code}}
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return Response(body, status_code=exc.status_code, headers=headers)


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    scheme, _, value = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def require_internal_token(
    token: str, *, worker_token: str | None = None, worker_streams: Iterable[str] = WORKER_STREAMS
) -> Guard:
    """A Litestar guard admitting only `Authorization: Bearer <token>` (constant-time check),
    or `Bearer <worker_token>` on a route whose `stream` path parameter is in `worker_streams`.

    Raises `InternalAPIError` (401, or 403 for the worker token out of its scope); register
    `error_response` for it, as `internal_router` does, to answer in the OpenAI error shape.
    """
    if not token:
        raise ValueError("the internal token must not be empty")
    expected = token.encode()
    worker = worker_token.encode() if worker_token and worker_token != token else None
    scope = frozenset(worker_streams)

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        given = bearer_token(connection)
        supplied = (given or "").encode()
        # compare_digest wants bytes (str must be ASCII); a missing token still costs a compare.
        internal = hmac.compare_digest(supplied, expected)
        as_worker = worker is not None and hmac.compare_digest(supplied, worker)
        if given is None or not (internal or as_worker):
            raise InternalAPIError(401, "Missing or invalid internal token.", "invalid_internal_token")
        if not internal and connection.path_params.get("stream") not in scope:
            raise InternalAPIError(
                403,
                "The worker token may publish heartbeats and KV events only.",
                "insufficient_scope",
                type="permission_error",
            )

    return guard


def internal_router(
    bus: EventBus, token: str, *, streams: Iterable[str] = KNOWN_STREAMS, worker_token: str | None = None
) -> Router:
    """The `/internal` router: `POST /internal/bus/{stream}` publishes a JSON object to `bus`
    (with the internal token; with `worker_token`, to the worker streams only)."""
    allowed = frozenset(streams)

    @post("/bus/{stream:str}", status_code=202)
    async def publish_event(stream: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, str]:
        if stream not in allowed:
            raise InternalAPIError(404, f"Unknown stream {stream!r}.", "unknown_stream")
        body = await request.body()
        try:
            event = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            # msgspec raises the last two for invalid UTF-8 in a string and for deep nesting.
            raise InternalAPIError(400, json_error(exc) or "JSON is malformed.", "invalid_json") from None
        if not isinstance(event, dict):
            raise InternalAPIError(400, "Body must be a JSON object.", "invalid_json")
        return {"id": await bus.publish(stream, event)}

    return Router(
        path="/internal",
        route_handlers=[publish_event],
        guards=[require_internal_token(token, worker_token=worker_token)],
        exception_handlers={InternalAPIError: error_response},
        include_in_schema=False,
    )
