"""A small billing world for the tests: organisations, models, deployments, prices, ledger
events and worker lifetimes written straight to the tables, and an admin app served by a
real uvicorn (so streamed responses really stream).

The usage lives in January 2025, a month long over, so its invoices may be finalized.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from litestar import Litestar
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from billing.models import Price, UsageEvent
from control_plane.bootstrap import bootstrap
from control_plane.catalog.models import Adapter, Deployment, Model, Worker
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import Organization
from tokenmill.settings import Settings

MONTH = "2025-01"
JAN = datetime(2025, 1, 1, tzinfo=UTC)
FEB = datetime(2025, 2, 1, tzinfo=UTC)
SECRET = "billing-test-secret"


def t(day: int, hour: int = 0, minute: int = 0, second: int = 0, micro: int = 0) -> datetime:
    """A moment of January 2025 (day 32 is February 1st)."""
    return JAN + timedelta(days=day - 1, hours=hour, minutes=minute, seconds=second, microseconds=micro)


@dataclass
class World:
    org_a: str
    org_b: str
    small: str  # model ids
    big: str
    small_dep: str  # serverless deployments
    big_dep: str
    dedicated: str  # org A's dedicated deployment of `big`, on "a100"
    adapter: str  # org A's adapter on `small`
    n: int = 0  # request ids handed out

    def usage(
        self,
        org: str,
        dep: str,
        at: datetime,
        prompt: int,
        cached: int = 0,
        output: int = 0,
        *,
        adapter: str | None = None,
        model: str = "m",
        user: str | None = None,
        client_request_id: str | None = None,
        service_tier: str = "default",
        batch_id: str | None = None,
    ) -> dict[str, Any]:
        """One ledger row (as `record_usage` would write it)."""
        self.n += 1
        return {
            "request_id": f"req-{self.n:07d}",
            "org_id": org,
            "model": model,
            "adapter": adapter,
            "deployment_id": dep,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": output,
            "status": "ok",
            "created_at": at,
            "user": user,
            "client_request_id": client_request_id,
            "service_tier": service_tier,
            "batch_id": batch_id,
        }


async def make_world(sm: async_sessionmaker[AsyncSession]) -> World:
    async with sm() as s, s.begin():
        org_a, org_b = Organization(name="acme"), Organization(name="globex")
        small = Model(name="small-model", source="x", format="hf", context_length=2048)
        big = Model(name="big-model", source="y", format="hf", context_length=2048)
        s.add_all([org_a, org_b, small, big])
        await s.flush()
        small_dep = Deployment(name="small-model", model_id=small.id, type="serverless")
        big_dep = Deployment(name="big-model", model_id=big.id, type="serverless")
        dedicated = Deployment(
            name="acme-big", model_id=big.id, org_id=org_a.id, type="dedicated", gpu_type="a100"
        )
        adapter = Adapter(org_id=org_a.id, model_id=small.id, name="acme-lora", source="z")
        s.add_all([small_dep, big_dep, dedicated, adapter])
        await s.flush()
        return World(org_a.id, org_b.id, small.id, big.id, small_dep.id, big_dep.id, dedicated.id, adapter.id)


async def add_usage(sm: async_sessionmaker[AsyncSession], rows: list[dict[str, Any]]) -> None:
    async with sm() as s, s.begin():
        for i in range(0, len(rows), 2000):
            await s.execute(insert(UsageEvent), rows[i : i + 2000])


async def add_model_price(
    sm: async_sessionmaker[AsyncSession],
    model_id: str,
    at: datetime,
    input: str,
    cached: str,
    output: str,
    currency: str = "usd",
    batch_discount: str | None = None,
) -> str:
    """A price version; without `batch_discount`, the column's default (half price)."""
    async with sm() as s, s.begin():
        price = Price(
            model_id=model_id,
            input_per_mtok=Decimal(input),
            cached_input_per_mtok=Decimal(cached),
            output_per_mtok=Decimal(output),
            currency=currency,
            effective_from=at,
        )
        if batch_discount is not None:
            price.batch_discount = Decimal(batch_discount)
        s.add(price)
        await s.flush()
        return price.id


async def add_gpu_price(sm: async_sessionmaker[AsyncSession], gpu: str, at: datetime, per_hour: str) -> str:
    async with sm() as s, s.begin():
        price = Price(gpu_type=gpu, gpu_hour=Decimal(per_hour), effective_from=at)
        s.add(price)
        await s.flush()
        return price.id


async def add_worker(
    sm: async_sessionmaker[AsyncSession],
    worker_id: str,
    deployment_id: str | None,
    started: datetime,
    *,
    stopped: datetime | None = None,
    last_seen: datetime | None = None,
    status: str = "stopped",
    gpu_type: str | None = None,
) -> None:
    async with sm() as s, s.begin():
        s.add(
            Worker(
                id=worker_id,
                deployment_id=deployment_id,
                address="http://127.0.0.1:1",
                model="m",
                gpu_type=gpu_type,
                status=status,
                started_at=started,
                stopped_at=stopped,
                last_seen_at=last_seen if last_seen is not None else stopped,
            )
        )


# --- the admin app ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve(app: Litestar) -> AsyncIterator[str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # leave pytest's handlers
    task = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"test server did not start on port {port}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@dataclass
class Api:
    client: httpx.AsyncClient
    sm: async_sessionmaker[AsyncSession]
    world: World
    keys: dict[str, str] = field(default_factory=dict)  # platform, admin_a, admin_b, member_a

    def h(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"}


@contextlib.asynccontextmanager
async def admin_api(db_url: str, home: Path, engine: AsyncEngine) -> AsyncIterator[Api]:
    """The admin API (control plane + billing) of `create_app` on a migrated database, with a
    platform admin key, an org admin key of each tenant and a member key of org A."""
    from tokenmill.app import Parts, create_app
    from tokenmill.db import make_sessionmaker

    sm = make_sessionmaker(engine)
    boot = await bootstrap(
        sm, secret_key=SECRET, model_name="boot-model", model_source="x", model_format="hf", context_length=64
    )
    assert boot.admin_secret
    world = await make_world(sm)
    keys = {"platform": boot.admin_secret}
    async with sm() as s, s.begin():
        svc = ApiKeyService(session=s)
        for who, org, role in (
            ("admin_a", world.org_a, "org_admin"),
            ("admin_b", world.org_b, "org_admin"),
            ("member_a", world.org_a, "member"),
        ):
            keys[who] = (await svc.create_key(org_id=org, secret_key=SECRET, role=role)).secret
    settings = Settings(home=home, database_url=db_url, secret_key=SECRET, internal_token="internal")
    app = create_app(settings, engine, Parts(admin=True))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield Api(client, sm, world, keys)
