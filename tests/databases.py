"""Databases at migration head for the tests, copied from one migrated template per run.

`migrate(url)` leaves a database where `migrations.upgrade(url)` would, without running the
history each time (a few hundred fixtures start from an empty database at head): the first
call per backend migrates a template, later calls copy it (SQLite's backup API; PostgreSQL's
CREATE DATABASE ... TEMPLATE, which copies blocks). A database that already holds something,
has other sessions open, or (PostgreSQL) was not made by `create`, gets the real upgrade.
The migrations themselves are tested on empty databases (tests/test_migrations.py), never
through this.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import secrets
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path

import asyncpg
from sqlalchemy.engine import URL, make_url

import migrations
from tokenmill.db import async_url

_lock = threading.Lock()  # fixtures call this from threads (migrations run their own loop)
_templates: dict[str, str] = {}  # "sqlite" -> template file; PostgreSQL server -> template name
_servers: dict[str, str] = {}  # database made by create() -> its server's plain URL


async def create(server: str, name: str) -> None:
    """An empty database `name` on the server at plain URL `server`."""
    conn = await asyncpg.connect(server)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    _servers[name] = server


async def drop(server: str, name: str) -> None:
    """Drop even if a test left connections open (an engine it never disposed)."""
    conn = await asyncpg.connect(server)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await conn.close()
    _servers.pop(name, None)


def migrate(url: str) -> None:
    """Blocking, as migrations.upgrade: call it from a thread when an event loop is running."""
    parsed = make_url(async_url(url))
    with _lock:
        if parsed.get_backend_name() == "sqlite":
            _sqlite(url, parsed)
        else:
            asyncio.run(_postgres(url, parsed))


def _sqlite(url: str, parsed: URL) -> None:
    path = Path(parsed.database) if parsed.database and parsed.database != ":memory:" else None
    if path is None or (path.exists() and path.stat().st_size > 0):
        migrations.upgrade(url)
        return
    if "sqlite" not in _templates:
        folder = Path(tempfile.mkdtemp(prefix="tm-head-"))
        atexit.register(shutil.rmtree, folder, True)
        migrations.upgrade(f"sqlite+aiosqlite:///{folder / 'head.db'}")
        _templates["sqlite"] = str(folder / "head.db")
    with (
        contextlib.closing(sqlite3.connect(_templates["sqlite"])) as source,
        contextlib.closing(sqlite3.connect(path)) as target,
    ):
        source.backup(target)


async def _postgres(url: str, parsed: URL) -> None:
    name = parsed.database or ""
    server = _servers.get(name)
    if server is None:  # not one of ours: nothing to copy over
        await asyncio.to_thread(migrations.upgrade, url)
        return
    target = await asyncpg.connect(parsed.set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        tables = await target.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'"
        )
    finally:
        await target.close()
    conn = await asyncpg.connect(server)
    try:
        others = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name)
        if tables or others:
            await asyncio.to_thread(migrations.upgrade, url)
            return
        template = _templates.get(server)
        if template is None:
            template = f"tm_head_{secrets.token_hex(6)}"
            await conn.execute(f'CREATE DATABASE "{template}"')
            atexit.register(_drop_at_exit, server, template)
            await asyncio.to_thread(migrations.upgrade, parsed.set(database=template).render_as_string(False))
            _templates[server] = template
        await conn.execute(f'DROP DATABASE "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await conn.close()


def _drop_at_exit(server: str, template: str) -> None:
    """A throwaway cluster is gone by then (nothing to do); a configured one keeps nothing
    of this run."""
    with contextlib.suppress(Exception):
        asyncio.run(asyncio.wait_for(drop(server, template), 5))
