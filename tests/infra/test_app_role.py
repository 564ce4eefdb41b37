"""The migration Job's `migrate upgrade` with TOKENMILL_APP_DATABASE_URL: the services' role is
created by the owner, reads and writes rows, and can change nothing in the schema.

Against a real PostgreSQL (the conftest's throwaway cluster or TEST_DATABASE_URL).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import asyncpg
import pytest
from sqlalchemy import make_url

import migrations
from migrations.roles import ensure_app_role


def _plain(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def app_url(pg_url: str) -> Iterator[str]:
    role = f"tm_app_{secrets.token_hex(4)}"
    password = "p@ss:w/rd'" + secrets.token_hex(8)  # quotes and URL characters survive
    yield make_url(pg_url).set(username=role, password=password).render_as_string(hide_password=False)

    async def drop() -> None:
        conn = await asyncpg.connect(_plain(pg_url))
        try:
            await conn.execute(f'DROP OWNED BY "{role}"')
            await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        finally:
            await conn.close()

    asyncio.run(drop())


async def test_the_app_role_gets_rows_not_ddl(pg_url: str, app_url: str) -> None:
    await asyncio.to_thread(migrations.upgrade, pg_url)
    role = await ensure_app_role(pg_url, app_url)
    assert role == make_url(app_url).username
    # Twice is fine (every upgrade runs it): the role exists, its password is set again.
    await ensure_app_role(pg_url, app_url)

    url = make_url(app_url)
    conn = await asyncpg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, database=url.database
    )
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [r["tablename"] for r in rows]
        assert "organizations" in tables
        await conn.execute(
            "INSERT INTO organizations (id, name, cache_salt, status, billing_mode, created_at)"
            " VALUES ('o1', 'acme', 'salt', 'active', 'invoices', now())"
        )
        assert await conn.fetchval("SELECT name FROM organizations WHERE id = 'o1'") == "acme"
        await conn.execute("UPDATE organizations SET name = 'acme2' WHERE id = 'o1'")
        await conn.execute("DELETE FROM organizations WHERE id = 'o1'")
        for ddl in (
            "CREATE TABLE intruder (id int)",
            "DROP TABLE organizations",
            "ALTER TABLE organizations ADD COLUMN x int",
            "TRUNCATE organizations",
            "CREATE ROLE another LOGIN",
        ):
            with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
                await conn.execute(ddl)
        attributes = await conn.fetchrow(
            "SELECT rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = current_user"
        )
        assert tuple(attributes) == (False, False, False)
    finally:
        await conn.close()
    # Only the SCRAM verifier was sent (a DDL statement log never holds the password).
    owner = await asyncpg.connect(_plain(pg_url))
    try:
        stored = await owner.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = $1", role)
    finally:
        await owner.close()
    assert stored.startswith("SCRAM-SHA-256$4096:") and url.password not in stored


async def test_the_owner_cannot_be_the_app_role(pg_url: str) -> None:
    with pytest.raises(ValueError, match="must not be the owner"):
        await ensure_app_role(pg_url, pg_url.replace("postgres@", "postgres:x@", 1))
    with pytest.raises(ValueError, match="PostgreSQL"):
        await ensure_app_role(pg_url, "sqlite+aiosqlite:///x.db")


def test_the_verifier_is_postgresql_s_scram_sha_256() -> None:
    from migrations.roles import scram_verifier

    # RFC 7677's example: user "user", password "pencil", salt W22ZaJ0SNY7soEsUEjb6gQ==, 4096.
    salt = __import__("base64").b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = scram_verifier("pencil", salt=salt)
    assert verifier == (
        "SCRAM-SHA-256$4096:W22ZaJ0SNY7soEsUEjb6gQ==$"
        "WG5d8oPm3OtcPnkdi4Uo7BkeZkBFzpcXkuLmtbsT4qY=:wfPLwcE6nTWhTAmQ7tl2KeoiWGPlZqQxSrmfPwDl2dU="
    )
    assert scram_verifier("pencil") != scram_verifier("pencil")  # a fresh salt each time
