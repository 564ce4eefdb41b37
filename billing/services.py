"""The usage ledger: events from the bus into `usage_events`, exactly once per request id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import UsageEvent
from tokenmill.bus import EventBus
from tokenmill.db import utcnow
from tokenmill.protocol import USAGE, UsageRecord

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


class UsageConsumer:
    """Tails the usage stream through a consumer group; acks only after the commit, so a crash
    between the two re-delivers and the unique request id absorbs the duplicate."""

    GROUP = "billing-ledger"

    def __init__(self, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], consumer: str) -> None:
        self.bus = bus
        self.sessionmaker = sessionmaker
        self.consumer = consumer
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-consumer")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        decoder = msgspec.json.Decoder(UsageRecord)
        while True:
            try:
                entries = await self.bus.read_group(USAGE, self.GROUP, self.consumer, block=1.0, count=500)
                if not entries:
                    continue
                records = []
                for _, raw in entries:
                    try:
                        records.append(decoder.decode(raw))
                    except msgspec.ValidationError:
                        log.error("dropping malformed usage event: %r", raw[:200])
                async with self.sessionmaker() as session, session.begin():
                    await record_usage(session, records)
                await self.bus.ack(USAGE, self.GROUP, *[i for i, _ in entries])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("usage consumer failed; retrying")
                await asyncio.sleep(1.0)
                # Hand the un-acked batch back so the next read retries it.
                await self.bus.replay_pending(USAGE, self.GROUP, self.consumer)
