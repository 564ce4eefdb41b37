"""The Alembic history round-trips and agrees with the models, on SQLite and PostgreSQL.

`migrations.upgrade`/`downgrade` block and run their own event loop (env.py calls asyncio.run),
so they go through `asyncio.to_thread` to stay off pytest-asyncio's session loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

import billing.models  # noqa: F401  (registers its tables on Base.metadata)
import control_plane.audit.models
import control_plane.catalog.models
import control_plane.orgs.models
import control_plane.plans.models  # noqa: F401
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
