"""The Alembic history round-trips and agrees with the models, on SQLite and PostgreSQL.

`migrations.upgrade`/`downgrade` block and run their own event loop (env.py calls asyncio.run),
so they go through `asyncio.to_thread` to stay off pytest-asyncio's session loop.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from advanced_alchemy.types import DateTimeUTC
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import JSON, Integer, column, insert, inspect, select, table, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.expression import TableClause

import billing.models  # noqa: F401  (registers its tables on Base.metadata)
import control_plane.audit.models
import control_plane.batches.models
import control_plane.catalog.models
import control_plane.files.models
import control_plane.orgs.models
import control_plane.plans.models
import control_plane.responses.models  # noqa: F401
import migrations
from tokenmill.db import Base, make_engine

MODEL_TABLES = frozenset(Base.metadata.tables)
VERSION_TABLE = "alembic_version"


def test_models_are_registered() -> None:
    # Guards the round trip below against passing vacuously with an empty metadata.
    assert {"organizations", "api_keys", "deployments", "prices", "usage_events"} <= MODEL_TABLES


async def _table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda sync_conn: inspect(sync_conn).get_table_names()))
    finally:
        await engine.dispose()


async def _current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))).scalar_one_or_none()
    finally:
        await engine.dispose()


async def _upgrade(url: str) -> None:
    await asyncio.to_thread(migrations.upgrade, url, "head")


async def _downgrade(url: str) -> None:
    await asyncio.to_thread(migrations.downgrade, url, "base")


async def test_upgrade_downgrade_round_trip(db_url: str) -> None:
    head = ScriptDirectory.from_config(migrations.config(db_url)).get_current_head()

    await _upgrade(db_url)
    assert await _table_names(db_url) - {VERSION_TABLE} == MODEL_TABLES
    assert await _current_revision(db_url) == head

    await _downgrade(db_url)
    assert await _table_names(db_url) - {VERSION_TABLE} == set()
    assert await _current_revision(db_url) is None

    # Downgrade must leave a database that upgrades cleanly again (no leftover indexes or types).
    await _upgrade(db_url)
    assert await _table_names(db_url) - {VERSION_TABLE} == MODEL_TABLES
    assert await _current_revision(db_url) == head


def _diff_against_models(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    return list(compare_metadata(context, Base.metadata))


async def test_migrations_match_models(db_url: str) -> None:
    """What `alembic revision --autogenerate` would emit after head: nothing."""
    await _upgrade(db_url)
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(_diff_against_models)
    finally:
        await engine.dispose()
    assert diff == [], "models and migrations disagree; add a revision:\n" + "\n".join(map(repr, diff))


DATETIME = DateTimeUTC(timezone=True)


def _table(name: str, *names: str, **typed: Any) -> TableClause:
    """Enough of a table, as the revision under test left it, to write and read rows."""
    return table(name, *(column(n) for n in names), *(column(n, t) for n, t in typed.items()))


async def test_0008_moves_the_gpu_count_into_its_column_and_back(db_url: str) -> None:
    """Deployments that existed keep the GPUs 0007 computed (`resources.gpus`, 1 by default,
    none on CPU), now in `gpus_per_replica`, on the builtin engine; worker lifetimes keep the
    one GPU they were billed as. A downgrade writes the count back where 0007 reads it."""
    await asyncio.to_thread(migrations.upgrade, db_url, "0007")
    now = datetime.now(UTC)
    models = _table(
        "models", "id", "name", "source", "format", "kind", context_length=Integer(), created_at=DATETIME
    )
    deployments = _table(
        "deployments", "id", "name", "model_id", "kind", "type", "gpu_type", "status", "engine",
        min_replicas=Integer(), max_replicas=Integer(), gpus_per_replica=Integer(), config=JSON(),
        engine_args=JSON(), created_at=DATETIME,
    )  # fmt: skip
    workers = _table("workers", "id", "deployment_id", "address", "model", "status", started_at=DATETIME)
    configs = {
        "dep_four": ("a100", {"resources": {"gpus": 4, "memory": "64Gi"}, "adapters": ["x"]}),
        "dep_one": ("a100", {"autoscaling": {"target_concurrency": 2}}),
        "dep_cpu": (None, None),
        "dep_odd": ("a100", {"resources": {"gpus": "lots"}}),
    }
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(models).values(
                    id="model_m", name="m", source="x", format="hf", kind="generate", context_length=2048,
                    created_at=now,
                )
            )  # fmt: skip
            for dep_id, (gpu, config) in configs.items():
                await conn.execute(
                    insert(deployments).values(
                        id=dep_id, name=dep_id, model_id="model_m", kind="generate", type="dedicated",
                        gpu_type=gpu, status="active", min_replicas=1, max_replicas=1, config=config,
                        created_at=now,
                    )
                )  # fmt: skip
            await conn.execute(
                insert(workers).values(
                    id="w1", deployment_id="dep_four", address="http://w", model="m", status="stopped",
                    started_at=now,
                )
            )  # fmt: skip
        await asyncio.to_thread(migrations.upgrade, db_url, "0008")
        d = deployments.c
        async with engine.connect() as conn:
            rows = await conn.execute(select(d.id, d.engine, d.engine_args, d.gpus_per_replica, d.config))
            assert {r[0]: tuple(r[1:]) for r in rows} == {
                "dep_four": ("builtin", {}, 4, {"resources": {"memory": "64Gi"}, "adapters": ["x"]}),
                "dep_one": ("builtin", {}, 1, {"autoscaling": {"target_concurrency": 2}}),
                "dep_cpu": ("builtin", {}, 0, None),
                "dep_odd": ("builtin", {}, 1, None),
            }
            assert (await conn.execute(text("SELECT gpus FROM workers"))).scalar_one() == 1
        await asyncio.to_thread(migrations.downgrade, db_url, "0007")
        async with engine.connect() as conn:
            back = {r[0]: r[1] for r in await conn.execute(select(d.id, d.config))}
            assert back["dep_four"] == {"resources": {"memory": "64Gi", "gpus": 4}, "adapters": ["x"]}
            assert back["dep_one"] == {"autoscaling": {"target_concurrency": 2}}
            assert back["dep_cpu"] is None
    finally:
        await engine.dispose()


async def _usage_columns(conn: AsyncConnection) -> set[str]:
    return {c["name"] for c in await conn.run_sync(lambda c: inspect(c).get_columns("usage_events"))}


async def test_0009_gives_past_usage_events_the_default_tier_and_back(db_url: str) -> None:
    """Events recorded before 0009 ran at the default tier, with no `user` or client id known,
    and so do those a writer without the columns inserts after it; new events keep all three
    (`user` is a reserved word in SQL: quoted on both databases). A downgrade drops the columns
    and keeps the events."""
    await asyncio.to_thread(migrations.upgrade, db_url, "0008")
    now = datetime.now(UTC)
    base = ("request_id", "org_id", "model", "status")
    counts = {"prompt_tokens": Integer(), "cached_tokens": Integer(), "completion_tokens": Integer()}
    old = _table("usage_events", *base, **counts, created_at=DATETIME)
    new = _table(
        "usage_events", *base, "user", "client_request_id", "service_tier", **counts, created_at=DATETIME
    )
    row = {"org_id": "org_a", "model": "m", "status": "ok", "created_at": now}
    row |= {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 1}
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(old).values(request_id="req_old", **row))
        await asyncio.to_thread(migrations.upgrade, db_url, "0009")
        async with engine.begin() as conn:
            # A writer that predates the columns (the last release's consumer, mid-rollout).
            await conn.execute(insert(old).values(request_id="req_rollout", **row))
            await conn.execute(
                insert(new).values(
                    request_id="req_new",
                    user="end-user ✓",
                    client_request_id="trace-1",
                    service_tier="flex",
                    **row,
                )
            )
        c = new.c
        async with engine.connect() as conn:
            got = await conn.execute(select(c.request_id, c.user, c.client_request_id, c.service_tier))
            assert {r[0]: tuple(r[1:]) for r in got} == {
                "req_old": (None, None, "default"),
                "req_rollout": (None, None, "default"),
                "req_new": ("end-user ✓", "trace-1", "flex"),
            }
        await asyncio.to_thread(migrations.downgrade, db_url, "0008")
        async with engine.connect() as conn:
            assert not {"user", "client_request_id", "service_tier"} & await _usage_columns(conn)
            kept = set((await conn.execute(select(old.c.request_id))).scalars())
            assert kept == {"req_old", "req_rollout", "req_new"}
        await asyncio.to_thread(migrations.upgrade, db_url, "0009")
        async with engine.connect() as conn:
            assert set((await conn.execute(select(c.service_tier))).scalars()) == {"default"}
    finally:
        await engine.dispose()
