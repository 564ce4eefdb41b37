"""The worker token: what workers hold instead of the internal token.

It is accepted on the internal bus endpoint for heartbeats and KV events only (a worker
cannot publish usage or key changes), a worker publishes and checks with it, and a worker
started by `serve` is given it and not the internal token.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from litestar import Litestar

from tokenmill import protocol
from tokenmill.bus import HttpPublisher, MemoryBus, make_publisher
from tokenmill.internal import WORKER_STREAMS, internal_router
from tokenmill.settings import Settings

INTERNAL = "internal-token-0123456789abcdef"
WORKER = "worker-token-fedcba9876543210"


def client_for(bus: MemoryBus, worker_token: str | None = WORKER) -> httpx.AsyncClient:
    app = Litestar(route_handlers=[internal_router(bus, INTERNAL, worker_token=worker_token)])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_worker_scope_is_heartbeats_and_kv_events() -> None:
    assert {protocol.WORKERS, protocol.KV} == WORKER_STREAMS
    assert protocol.USAGE not in WORKER_STREAMS and protocol.KEYS not in WORKER_STREAMS


async def test_worker_token_publishes_heartbeats_and_kv_events_only() -> None:
    bus = MemoryBus()
    async with client_for(bus) as client:
        for stream in (protocol.WORKERS, protocol.KV):
            resp = await client.post(f"/internal/bus/{stream}", json={"a": 1}, headers=bearer(WORKER))
            assert resp.status_code == 202, (stream, resp.text)
        for stream in (protocol.USAGE, protocol.KEYS):
            resp = await client.post(f"/internal/bus/{stream}", json={"a": 1}, headers=bearer(WORKER))
            assert resp.status_code == 403, stream
            assert resp.json()["error"]["code"] == "insufficient_scope"
        # The internal token keeps its full scope.
        resp = await client.post(f"/internal/bus/{protocol.USAGE}", json={"a": 1}, headers=bearer(INTERNAL))
        assert resp.status_code == 202
        # Anything else is still a 401, whatever the stream.
        resp = await client.post(f"/internal/bus/{protocol.KV}", json={}, headers=bearer(WORKER + "x"))
        assert resp.status_code == 401
    assert len(await bus.read(protocol.USAGE, "0", block=0)) == 1  # only the internal token's
    assert len(await bus.read(protocol.WORKERS, "0", block=0)) == 1


async def test_without_a_worker_token_only_the_internal_one_is_accepted() -> None:
    bus = MemoryBus()
    async with client_for(bus, worker_token=None) as client:
        resp = await client.post(f"/internal/bus/{protocol.KV}", json={}, headers=bearer(WORKER))
        assert resp.status_code == 401
    async with client_for(bus, worker_token=INTERNAL) as client:  # the same token: full scope
        resp = await client.post(f"/internal/bus/{protocol.USAGE}", json={}, headers=bearer(INTERNAL))
        assert resp.status_code == 202


async def test_a_worker_publishes_with_its_own_token() -> None:
    settings = Settings(redis_url=None, bus_url="http://x/internal/bus", internal_token=INTERNAL)
    settings.worker_token = WORKER
    publisher = make_publisher(settings)
    assert isinstance(publisher, HttpPublisher)
    assert publisher._headers["Authorization"] == f"Bearer {WORKER}"
    await publisher.close()
    assert settings.worker_credential == WORKER
    settings.worker_token = None
    assert settings.worker_credential == INTERNAL


def test_local_workers_get_the_worker_token_and_not_the_internal_one(tmp_path: Path) -> None:
    from tokenmill.app import local_worker_env

    settings = Settings(home=tmp_path, internal_token=INTERNAL, worker_token=WORKER, redis_url=None)
    env = local_worker_env(settings)
    assert env["TOKENMILL_WORKER_TOKEN"] == WORKER
    assert env["TOKENMILL_INTERNAL_TOKEN"] == ""  # overrides an inherited one
    alone = Settings(home=tmp_path, internal_token=INTERNAL, redis_url=None)
    env = local_worker_env(alone)
    assert env["TOKENMILL_WORKER_TOKEN"] == env["TOKENMILL_INTERNAL_TOKEN"] == INTERNAL


def test_graceful_shutdown_is_at_least_the_longest_stream() -> None:
    assert Settings().graceful_shutdown_seconds == Settings().max_stream_seconds
    assert Settings(max_stream_seconds=300, shutdown_grace_seconds=330).graceful_shutdown_seconds == 330
    with pytest.raises(ValueError, match="MAX_STREAM_SECONDS"):
        Settings(max_stream_seconds=300, shutdown_grace_seconds=10)


async def test_uvicorn_gets_the_graceful_timeout_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import uvicorn

    from tokenmill import cli

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    class Config(uvicorn.Config):
        def __init__(self, app: object, **kwargs: object) -> None:
            seen.update(kwargs)
            raise Stop

    monkeypatch.setattr(uvicorn, "Config", Config)
    settings = Settings(max_stream_seconds=412.5)
    with socket.socket() as sock, pytest.raises(Stop):
        await cli._serve_app(Litestar(route_handlers=[]), sock, settings)
    assert seen["timeout_graceful_shutdown"] == 413
