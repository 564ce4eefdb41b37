"""Refused requests: the gateways' per-minute counts added to `refusals`, and what the
dashboard reads of them (refusals per time bucket, and by reason).

A gateway adds what it counted since its last flush; several gateways (or two flushes of
one minute) add to the same row, so a row holds every refusal of its key, reason and minute.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import bucket_edges, dialect_insert, per_bucket
from billing.models import Refusal

# org id, API key id, reason, start of the UTC minute: one row of `refusals`.
RefusalKey = tuple[str, str, str, datetime]
_KEY_COLUMNS = ["org_id", "api_key_id", "reason", "minute"]
# Rows per INSERT: SQLite allows 32,766 bound values a statement, 5 a row here.
_CHUNK = 1000


async def add_refusals(session: AsyncSession, counts: Mapping[RefusalKey, int]) -> None:
    """Add `counts` to their rows (created at first). In key order, so two gateways adding
    the same rows at once lock them in the same order and never deadlock."""
    rows = [
        {"org_id": org, "api_key_id": key, "reason": reason, "minute": minute, "count": n}
        for (org, key, reason, minute), n in sorted(counts.items())
        if n
    ]
    insert = dialect_insert(session)
    for i in range(0, len(rows), _CHUNK):
        stmt = insert(Refusal).values(rows[i : i + _CHUNK])
        stmt = stmt.on_conflict_do_update(
            index_elements=_KEY_COLUMNS, set_={"count": Refusal.count + stmt.excluded.count}
        )
        await session.execute(stmt)


def _filters(by_org: bool, by_key: bool) -> list[Any]:
    filters = []
    if by_org:
        filters.append(Refusal.org_id == bindparam("org_id"))
    if by_key:
        filters.append(Refusal.api_key_id == bindparam("key_id"))
    return filters


@functools.lru_cache(maxsize=64)
def _buckets_stmt(n: int, by_org: bool, by_key: bool) -> Any:
    filters = _filters(by_org, by_key)
    return per_bucket(Refusal.minute, n, lambda i: select(i, func.sum(Refusal.count)).where(*filters))


async def refusals_per_bucket(
    session: AsyncSession,
    starts: Sequence[datetime],
    end: datetime,
    org_id: str | None = None,
    key_id: str | None = None,
) -> list[int]:
    """Refused requests in each bucket [starts[i], starts[i + 1]) (the last one ends at
    `end`), of one organisation or key or of all, in one round trip."""
    refused = [0 for _ in starts]
    stmt = _buckets_stmt(len(starts), org_id is not None, key_id is not None)
    params = bucket_edges(starts, end) | {"org_id": org_id, "key_id": key_id}
    for i, n in await session.execute(stmt, params):
        refused[int(i)] = int(n or 0)
    return refused


async def refusals_by_reason(
    session: AsyncSession,
    start: datetime,
    end: datetime,
    org_id: str | None = None,
    key_id: str | None = None,
) -> dict[str, int]:
    """Refused requests in [start, end) by reason, most frequent first."""
    stmt = (
        select(Refusal.reason, func.sum(Refusal.count))
        .where(
            Refusal.minute >= start, Refusal.minute < end, *_filters(org_id is not None, key_id is not None)
        )
        .group_by(Refusal.reason)
    )
    rows = await session.execute(stmt, {"org_id": org_id, "key_id": key_id})
    found = {reason: int(n or 0) for reason, n in rows}
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))
