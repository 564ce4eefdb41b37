"""The application's own database role, set up by `tokenmill migrate upgrade` (run as the
database owner, e.g. RDS's master user, from the migration Job) when TOKENMILL_APP_DATABASE_URL
names it.

The services then connect as that role: it reads and writes rows, and nothing more. It owns
nothing, cannot create, alter or drop tables, and cannot create roles or databases; only the
migrations (as the owner) change the schema. Run after every upgrade, so tables a migration
adds are granted too (and default privileges cover what the owner creates later).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from sqlalchemy import make_url, text

from tokenmill.db import make_engine

# Data access only: no TRUNCATE, REFERENCES or TRIGGER, no CREATE on the schema.
TABLE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
SEQUENCE_PRIVILEGES = "USAGE, SELECT, UPDATE"


def app_role(app_url: str) -> tuple[str, str]:
    """(role, password) of the services' database URL."""
    url = make_url(app_url)
    if not url.drivername.startswith("postgresql"):
        raise ValueError("TOKENMILL_APP_DATABASE_URL must be a PostgreSQL URL")
    if not url.username or not url.password:
        raise ValueError("TOKENMILL_APP_DATABASE_URL must name a user and a password")
    return url.username, str(url.password)


def scram_verifier(password: str, *, iterations: int = 4096, salt: bytes | None = None) -> str:
    """PostgreSQL's SCRAM-SHA-256 verifier of `password` (what pg_authid stores). Sent instead
    of the password, so a statement log (RDS logs DDL) never holds the password itself."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def statements(role: str) -> list[str]:
    """The grants, as `format()` templates of the role's name (quoted by the server: %I)."""
    return [
        # Whatever the role was before, it is a plain login role now.
        "ALTER ROLE %I NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        "REVOKE ALL ON SCHEMA public FROM %I",
        "GRANT USAGE ON SCHEMA public TO %I",
        f"GRANT {TABLE_PRIVILEGES} ON ALL TABLES IN SCHEMA public TO %I",
        f"GRANT {SEQUENCE_PRIVILEGES} ON ALL SEQUENCES IN SCHEMA public TO %I",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {TABLE_PRIVILEGES} ON TABLES TO %I",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT {SEQUENCE_PRIVILEGES} ON SEQUENCES TO %I",
    ]


async def ensure_app_role(owner_url: str, app_url: str) -> str:
    """Create the services' role (or set its password), then grant it data access; the role."""
    role, password = app_role(app_url)
    if make_url(owner_url).username == role:
        raise ValueError("the services' role must not be the owner that runs the migrations")
    engine = make_engine(owner_url)
    try:
        async with engine.begin() as conn:
            exists = await conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
            database = await conn.scalar(text("SELECT current_database()"))
            verb = "ALTER" if exists else "CREATE"
            # The server quotes names (%I) and literals (%L): nothing is spliced in here.
            steps: list[tuple[str, list[str]]] = [
                (f"{verb} ROLE %I LOGIN PASSWORD %L", [role, scram_verifier(password)]),
                ("GRANT CONNECT, TEMPORARY ON DATABASE %I TO %I", [database, role]),
            ]
            steps += [(template, [role] * template.count("%I")) for template in statements(role)]
            for template, args in steps:
                sql = await conn.scalar(
                    text("SELECT format(CAST(:t AS text), VARIADIC CAST(:args AS text[]))"),
                    {"t": template, "args": args},
                )
                await conn.exec_driver_sql(sql)  # as formatted: its literals are not bind parameters
    finally:
        await engine.dispose()
    return role
