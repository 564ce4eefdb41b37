"""Writing and reading the audit log.

Every change an admin makes goes through a service method that also writes its audit entry
into the same session (`record_change`), so both commit or roll back together.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import inspect, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.models import AuditEntry
from control_plane.policy import Principal, org_scope, require_visible_org
from tokenmill.db import Base, utcnow

# Columns whose name has one of these words, or ends in "key", never reach the audit log
# (API key hashes, password hashes, cache salts, any future token, secret or API key
# column), whatever the table; ids of keys (`api_key_id`) stay.
_SECRET_WORDS = frozenset(
    {"hash", "secret", "secrets", "password", "token", "salt", "credential", "credentials"}
)


def _is_secret(column: str) -> bool:
    words = column.lower().split("_")
    return not _SECRET_WORDS.isdisjoint(words) or words[-1] in ("key", "keys")


def snapshot(row: Base) -> dict[str, Any]:
    """A row's columns as JSON-ready values, without anything secret."""
    out = {a.key: getattr(row, a.key) for a in inspect(row).mapper.column_attrs if not _is_secret(a.key)}
    return msgspec.to_builtins(out)  # datetimes as ISO 8601, Decimals as strings


async def record_change(
    session: AsyncSession,
    actor: Principal,
    action: str,
    resource_type: str,
    resource_id: str,
    *,
    org_id: str | None,
    before: Base | dict[str, Any] | None = None,
    after: Base | dict[str, Any] | None = None,
) -> AuditEntry:
    """Add an audit entry to `session` (committed with the change it describes). `before`
    and `after` are rows (snapshotted here) or snapshots taken earlier."""
    entry = AuditEntry(
        at=utcnow(),
        actor_key_id=actor.key_id,
        actor_user_id=actor.user_id,
        org_id=org_id,
        action=action,
        resource_type=resource_type,
        resource_id=resource_id,
        before=snapshot(before) if isinstance(before, Base) else before,
        after=snapshot(after) if isinstance(after, Base) else after,
    )
    session.add(entry)
    return entry


async def delete_recorded(
    session: AsyncSession, actor: Principal, row: Base, resource_type: str, *, org_id: str | None
) -> None:
    """Delete `row` with its audit entry (the row as it was)."""
    before = snapshot(row)
    resource_id = str(before["id"])
    await session.delete(row)
    await session.flush()
    await record_change(session, actor, "delete", resource_type, resource_id, org_id=org_id, before=before)


@dataclass(slots=True)
class AuditQuery:
    org_id: str | None = None
    resource_type: str | None = None
    resource_id: str | None = None
    action: str | None = None
    actor_key_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after: int | None = None  # the id of the last entry of the previous page
    limit: int = 100


class AuditService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def page(self, query: AuditQuery, actor: Principal) -> tuple[list[AuditEntry], bool]:
        """Entries newest first, and whether more follow. Organisation admins read their
        own organisation's entries only (asking for another's is a 404)."""
        org_id = query.org_id
        if org_id is not None:
            require_visible_org(actor, org_id)
        else:
            org_id = org_scope(actor)
        stmt = select(AuditEntry)
        for column, value in (
            (AuditEntry.org_id, org_id),
            (AuditEntry.resource_type, query.resource_type),
            (AuditEntry.resource_id, query.resource_id),
            (AuditEntry.action, query.action),
            (AuditEntry.actor_key_id, query.actor_key_id),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if query.since is not None:
            stmt = stmt.where(AuditEntry.at >= query.since)
        if query.until is not None:
            stmt = stmt.where(AuditEntry.at < query.until)
        if query.after is not None:
            stmt = stmt.where(AuditEntry.id < query.after)
        rows = list(await self.session.scalars(stmt.order_by(AuditEntry.id.desc()).limit(query.limit + 1)))
        return rows[: query.limit], len(rows) > query.limit
