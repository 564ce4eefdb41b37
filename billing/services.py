"""The usage ledger: events from the bus into `usage_events`, exactly once per request id."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import UsageEvent
from tokenmill.bus import Entry, EventBus
from tokenmill.db import utcnow
from tokenmill.protocol import USAGE, UsageRecord
from tokenmill.tasks import GroupConsumer

log = logging.getLogger("tokenmill.billing")


def _row(rec: UsageRecord) -> dict[str, Any]:
    return {
        "request_id": rec.request_id,
        "org_id": rec.org_id,
        "api_key_id": rec.api_key_id,
        "model": rec.model,
        "adapter": rec.adapter,
        "deployment_id": rec.deployment_id,
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "completion_tokens": rec.completion_tokens,
        "ttft_ms": rec.ttft_ms,
        "duration_ms": rec.duration_ms,
        "status": rec.status,
        "created_at": datetime.fromtimestamp(rec.ts, UTC) if rec.ts else utcnow(),
    }


async def record_usage(session: AsyncSession, records: list[UsageRecord]) -> int:
    """Insert records, skipping request ids already in the ledger. Returns rows inserted."""
    if not records:
        return 0
    dialect = session.bind.dialect.name if session.bind else "sqlite"
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert(UsageEvent)
        .values([_row(r) for r in records])
        .on_conflict_do_nothing(index_elements=["request_id"])
    )
    result = await session.execute(stmt)
    return result.rowcount or 0


class UsageConsumer(GroupConsumer):
    """Usage events into the ledger. Acks follow the commit, so a crash between the two
    re-delivers and the unique request id absorbs the duplicate."""

    name = "usage-consumer"
    stream = USAGE
    group = "billing-ledger"
    count = 500

    def __init__(self, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], consumer: str) -> None:
        super().__init__(bus, consumer)
        self.sessionmaker = sessionmaker
        self._decoder = msgspec.json.Decoder(UsageRecord)

    async def handle(self, entries: list[Entry]) -> None:
        records = []
        for _, raw in entries:
            try:
                records.append(self._decoder.decode(raw))
            except msgspec.ValidationError:
                log.error("dropping malformed usage event: %r", raw[:200])
        async with self.sessionmaker() as session, session.begin():
            await record_usage(session, records)
