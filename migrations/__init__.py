"""One Alembic history for every table; runs on SQLite (aiosqlite) and PostgreSQL (asyncpg)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).parent


def config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    # Alembic's ini interpolation treats % specially; passwords may contain it.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Blocking: call from a thread when an event loop is running (env.py runs its own)."""
    command.upgrade(config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(config(url), revision)


def current(url: str) -> str | None:
    """Blocking: the revision the database is at (None for an empty database)."""
    return asyncio.run(_current(url))


async def _current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    from tokenmill.db import make_engine

    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
    finally:
        await engine.dispose()
