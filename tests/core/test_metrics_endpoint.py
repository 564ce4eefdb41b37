"""`/metrics` of a process without a gateway (the control plane's ledger consumer): the same
token rule as everywhere, and the registries of the parts it runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tokenmill.app import Parts, create_app
from tokenmill.db import make_engine
from tokenmill.settings import Settings

INTERNAL = "internal-token-0123456789abcdef"
WORKER = "worker-token-fedcba9876543210"


async def client(tmp_path: Path, **tokens: str | None) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        home=tmp_path, database_url=f"sqlite+aiosqlite:///{tmp_path / 'cp.db'}", secret_key="s", **tokens
    )
    engine = make_engine(settings.db_url)
    app = create_app(settings, engine, Parts(consumers=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp") as c:
        yield c
    await engine.dispose()


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for c in client(tmp_path, internal_token=INTERNAL, worker_token=WORKER):
        yield c


async def test_the_internal_or_the_workers_token_reads_the_ledger_metrics(
    control_plane: httpx.AsyncClient,
) -> None:
    for token in (INTERNAL, WORKER):
        r = await control_plane.get("/metrics", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        assert "tokenmill_ledger_events_total 0.0" in r.text and "tokenmill_ledger_lag_seconds" in r.text
        assert "python_info" in r.text  # the process's default registry too
        assert "tokenmill_gateway_" not in r.text  # no gateway here
    for headers in ({}, {"authorization": f"Bearer {INTERNAL}x"}, {"authorization": f"Basic {INTERNAL}"}):
        r = await control_plane.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token", headers


async def test_without_any_token_configured_nothing_reads_them(tmp_path: Path) -> None:
    async for c in client(tmp_path, internal_token=None, worker_token=None):
        for headers in ({}, {"authorization": "Bearer "}, {"authorization": "Bearer None"}):
            assert (await c.get("/metrics", headers=headers)).status_code == 401, headers
