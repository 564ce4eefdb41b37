"""Internal HTTP endpoints, mounted at `/internal`, for traffic inside the deployment.

In the embedded mode there is no Redis: local workers publish heartbeats and KV events
to the server's in-memory bus through `POST /internal/bus/{stream}`. Every internal
endpoint requires the internal token, so nothing on the network can inject fleet state
or usage without it.
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
from tokenmill.bus import EventBus

# Streams a caller may publish to; anything else is a 404 so a typo or a probe cannot
# create arbitrary keys in the bus.
KNOWN_STREAMS = frozenset({protocol.WORKERS, protocol.KV, protocol.USAGE, protocol.KEYS})


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


def require_internal_token(token: str) -> Guard:
    """A Litestar guard admitting only `Authorization: Bearer <token>` (constant-time check).

    Raises `InternalAPIError` (401); register `error_response` for it, as `internal_router`
    does, to answer in the OpenAI error shape.
    """
    if not token:
        raise ValueError("the internal token must not be empty")
    expected = token.encode()

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        given = bearer_token(connection)
        # compare_digest wants bytes (str must be ASCII); a missing token still costs a compare.
        if not hmac.compare_digest((given or "").encode(), expected) or given is None:
            raise InternalAPIError(401, "Missing or invalid internal token.", "invalid_internal_token")

    return guard


def internal_router(bus: EventBus, token: str, *, streams: Iterable[str] = KNOWN_STREAMS) -> Router:
    """The `/internal` router: `POST /internal/bus/{stream}` publishes a JSON object to `bus`."""
    allowed = frozenset(streams)

    @post("/bus/{stream:str}", status_code=202)
    async def publish_event(stream: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, str]:
        if stream not in allowed:
            raise InternalAPIError(404, f"Unknown stream {stream!r}.", "unknown_stream")
        body = await request.body()
        try:
            event = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise InternalAPIError(400, f"Body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(event, dict):
            raise InternalAPIError(400, "Body must be a JSON object.", "invalid_json")
        return {"id": await bus.publish(stream, event)}

    return Router(
        path="/internal",
        route_handlers=[publish_event],
        guards=[require_internal_token(token)],
        exception_handlers={InternalAPIError: error_response},
        include_in_schema=False,
    )
