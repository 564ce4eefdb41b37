"""Operational endpoints every server process has: `/health` and `/metrics`."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import MediaType, Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill import __version__
from tokenmill.errors import APIError
from tokenmill.internal import bearer_token
from tokenmill.settings import Settings


@get("/health", include_in_schema=False)
async def health(request: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"status": "ok", "version": __version__}
    gateway = request.app.state.get("gateway")
    if gateway is not None:
        body["workers"] = len([w for w in gateway.fleet.workers.values() if not w.draining])
    return body


@get("/metrics", include_in_schema=False, media_type=MediaType.TEXT)
async def metrics(request: Request) -> Response[bytes]:
    """The process's default registry, then the app's own (gateway, ledger consumer...)."""
    check_scraper(request, request.app.state.settings)
    body = generate_latest()
    for registry in request.app.state.get("metrics_registries", ()):
        body += generate_latest(registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def check_scraper(request: Request, settings: Settings) -> None:
    """401 unless the request bears the internal token or the workers' token. Metrics name
    deployments and show the traffic, so they are not public; the workers' token is enough
    (it only reads here), so a Prometheus that scrapes the workers holds no other secret.
    A process without either token serves no metrics."""
    supplied = (bearer_token(request) or "").encode()
    ok = False
    for token in (settings.internal_token, settings.worker_token):
        # Both compared, whichever matches: the time taken says nothing about which.
        ok |= bool(token) and hmac.compare_digest(supplied, (token or "").encode())
    if not ok:
        raise APIError(
            401,
            "Missing or invalid internal token: /metrics needs 'Authorization: Bearer <token>' with "
            "TOKENMILL_INTERNAL_TOKEN or TOKENMILL_WORKER_TOKEN.",
            code="invalid_internal_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> dict[str, Any]:
    """The OpenAPI document where OpenAI-style tooling looks for it (also at /docs/openapi.json)."""
    return request.app.openapi_schema.to_schema()
