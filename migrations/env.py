"""Alembic environment: async engines, batch mode so SQLite can ALTER."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

import billing.models  # noqa: F401  (registers tables on Base.metadata)
import control_plane.audit.models
import control_plane.batches.models
import control_plane.catalog.models
import control_plane.files.models
import control_plane.orgs.models
import control_plane.plans.models
import control_plane.responses.models  # noqa: F401
from tokenmill.db import Base, async_url, make_engine

target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=async_url(context.config.get_main_option("sqlalchemy.url") or ""),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    engine = make_engine(context.config.get_main_option("sqlalchemy.url") or "")
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
