"""Writing and reading the audit log.

Every change an admin makes goes through a service method that also writes its audit entry
into the same session (`record_change`), so both commit or roll back together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import inspect, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from control_plane.audit.models import AuditEntry
from control_plane.orgs.models import ApiKey, User
from control_plane.paging import Page, PageQuery, any_contains, contains, keyset_page
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


# What the services record, for the dashboard's filters (any other value still filters).
RESOURCE_TYPES = (
    "organization",
    "user",
    "api_key",
    "model",
    "adapter",
    "deployment",
    "plan",
    "price",
    "invoice",
)
ACTIONS = ("create", "update", "delete", "revoke", "rotate", "suspend", "resume", "finalize")


@dataclass(slots=True)
class AuditQuery:
    """Filters of the audit log (each None: any). `actor` is a user's email or id or an API
    key's prefix or id, matched exactly; `since` inclusive, `until` exclusive."""

    org_id: str | None = None
    resource_type: str | None = None
    resource_id: str | None = None
    action: str | None = None
    actor_key_id: str | None = None
    actor_user_id: str | None = None
    actor: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change, as a reader may be told: a user's email, an API key's prefix (and
    name), or the system. Someone outside the reader's organisation (a platform admin acting
    on it) is named by role only."""

    kind: str  # user | key | system | platform
    label: str
    detail: str = ""  # a key's name


SYSTEM_ACTOR = Actor("system", "system")
PLATFORM_ACTOR = Actor("platform", "a platform admin")


def _entry_cursor(cursor: str) -> tuple[int]:
    # The log sorts by its id alone, so the cursor is the position itself: an entry need not
    # exist (any id pages), and nothing is looked up. Not a number: ValueError, a 400.
    return (int(cursor),)


def _actors(scope: str | None, users: ColumnElement[bool], keys: ColumnElement[bool]) -> ColumnElement[bool]:
    """Entries made by the users or keys matching `users` / `keys`, among those of the
    reader's organisation (`scope`; None: all), so nobody learns, by a search that finds
    their own entries, how someone outside their organisation is named."""
    user_ids = select(User.id).where(users)
    key_ids = select(ApiKey.id).where(keys)
    if scope is not None:
        user_ids, key_ids = user_ids.where(User.org_id == scope), key_ids.where(ApiKey.org_id == scope)
    return or_(AuditEntry.actor_user_id.in_(user_ids), AuditEntry.actor_key_id.in_(key_ids))


def _search(scope: str | None) -> Callable[[str], ColumnElement[bool]]:
    """An entry's action, resource type or id, or its actor (user email or id, key prefix,
    name or id) holds the text."""

    def search(text: str) -> ColumnElement[bool]:
        # Actions, types and ids are lowercase: compared without folding 100,000 rows.
        columns = (AuditEntry.action, AuditEntry.resource_type, AuditEntry.resource_id)
        return or_(
            *(contains(c, text, lowercase=True) for c in columns),
            _actors(
                scope,
                or_(contains(User.email, text), contains(User.id, text, lowercase=True)),
                or_(
                    any_contains(text, ApiKey.prefix, ApiKey.name), contains(ApiKey.id, text, lowercase=True)
                ),
            ),
        )

    return search


class AuditService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def page(self, query: AuditQuery, actor: Principal, page: PageQuery) -> Page[AuditEntry]:
        """Entries newest first (`page.order` "asc": oldest first), filtered by `query` and
        searched by `page.q`. Organisation admins read their own organisation's entries only
        (asking for another's is a 404); platform-wide entries (models, plans, prices) are
        the platform admins'."""
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
            (AuditEntry.actor_user_id, query.actor_user_id),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        scope = org_scope(actor)
        if query.actor is not None:
            who = query.actor.strip()
            stmt = stmt.where(
                _actors(
                    scope,
                    or_(User.id == who, User.email == who.lower()),
                    or_(ApiKey.id == who, ApiKey.prefix == who.rstrip("…")),
                )
            )
        if query.since is not None:
            stmt = stmt.where(AuditEntry.at >= query.since)
        if query.until is not None:
            stmt = stmt.where(AuditEntry.at < query.until)
        return await keyset_page(
            self.session,
            stmt,
            page,
            by=[(AuditEntry.id, True)],
            search=_search(scope),
            cursor_values=_entry_cursor,
        )

    async def actors(self, entries: Sequence[AuditEntry], reader: Principal) -> dict[int, Actor]:
        """Who made each entry (by entry id), as `reader` may be told: users and keys of
        organisations `reader` sees by email and prefix, anyone else as a platform admin."""
        user_ids = {e.actor_user_id for e in entries if e.actor_user_id}
        key_ids = {e.actor_key_id for e in entries if e.actor_key_id and not e.actor_user_id}
        users = (
            {u.id: u for u in await self.session.scalars(select(User).where(User.id.in_(user_ids)))}
            if user_ids
            else {}
        )
        keys = (
            {k.id: k for k in await self.session.scalars(select(ApiKey).where(ApiKey.id.in_(key_ids)))}
            if key_ids
            else {}
        )
        found: dict[int, Actor] = {}
        for entry in entries:
            user = users.get(entry.actor_user_id or "")
            key = keys.get(entry.actor_key_id or "")
            if user is not None:
                seen = reader.sees(user.org_id)
                found[entry.id] = Actor("user", user.email) if seen else PLATFORM_ACTOR
            elif key is not None:
                seen = reader.sees(key.org_id)
                found[entry.id] = Actor("key", f"{key.prefix}…", key.name) if seen else PLATFORM_ACTOR
            elif entry.actor_user_id or entry.actor_key_id:
                # Deleted since (users and keys are rarely deleted, organisations may be).
                found[entry.id] = Actor("user" if entry.actor_user_id else "key", "(deleted)")
            else:
                found[entry.id] = SYSTEM_ACTOR
        return found
