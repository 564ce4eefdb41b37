"""Operational endpoints every server process has: `/health` and `/metrics`."""

from __future__ import annotations

from typing import Any

from litestar import MediaType, Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill import __version__


@get("/health", include_in_schema=False)
async def health(request: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"status": "ok", "version": __version__}
    gateway = request.app.state.get("gateway")
    if gateway is not None:
        body["workers"] = len([w for w in gateway.fleet.workers.values() if not w.draining])
    return body


@get("/metrics", include_in_schema=False, media_type=MediaType.TEXT)
async def metrics() -> Response[bytes]:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> dict[str, Any]:
    """The OpenAPI document where OpenAI-style tooling looks for it (also at /docs/openapi.json)."""
    return request.app.openapi_schema.to_schema()
