from __future__ import annotations

import asyncio
import time

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger.services import UsageConsumer, record_usage
from billing.models import UsageEvent
from tokenmill.bus import MemoryBus
from tokenmill.protocol import USAGE, UsageRecord


def _rec(i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"req_{i}", org_id="org_a", model="m", prompt_tokens=10 + i, completion_tokens=i
    )


async def test_insert_is_idempotent(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    async with migrated_db() as s, s.begin():
        assert await record_usage(s, [_rec(1), _rec(2)]) == 2
    async with migrated_db() as s, s.begin():
        # a redelivered batch, overlapping the first
        assert await record_usage(s, [_rec(2), _rec(3), _rec(1)]) == 1
    async with migrated_db() as s:
        rows = (await s.execute(select(UsageEvent).order_by(UsageEvent.request_id))).scalars().all()
    assert [r.request_id for r in rows] == ["req_1", "req_2", "req_3"]
    assert sum(r.prompt_tokens for r in rows) == 11 + 12 + 13


async def test_consumer_moves_events_into_the_ledger(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    bus = MemoryBus()
    consumer = UsageConsumer(bus, migrated_db, "c1")
    await consumer.start()
    try:
        for i in range(50):
            await bus.publish(USAGE, _rec(i))
        await bus.publish(USAGE, _rec(7))  # duplicate delivery
        await bus.publish(USAGE, {"nonsense": True})  # malformed: dropped, not fatal
        for _ in range(100):
            async with migrated_db() as s:
                n = await s.scalar(select(func.count()).select_from(UsageEvent))
            if n == 50:
                break
            await asyncio.sleep(0.05)
        assert n == 50
        async with migrated_db() as s:
            total = await s.scalar(select(func.sum(UsageEvent.completion_tokens)))
        assert total == sum(range(50))
    finally:
        await consumer.stop()
        await bus.close()


async def test_consumer_counts_events_and_batches_and_reports_its_lag(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    consumer = UsageConsumer(MemoryBus(), migrated_db, "c1")
    sent = time.time() - 5.0  # the newest event was published five seconds ago
    records = [msgspec.structs.replace(_rec(i), ts=sent - i) for i in range(3)]
    entries = [(f"{i}-0", msgspec.json.encode(r)) for i, r in enumerate(records)]
    await consumer.handle(entries)
    await consumer.handle(entries[1:2])  # redelivered: consumed again, skipped by the ledger
    registry = consumer.metrics.registry
    assert registry.get_sample_value("tokenmill_ledger_events_total") == 4
    assert registry.get_sample_value("tokenmill_ledger_batches_total") == 2
    # The newest event of the last batch (entries[1]) was six seconds old when it was written.
    assert 6.0 <= (registry.get_sample_value("tokenmill_ledger_lag_seconds") or 0.0) < 60


async def test_ledger_stores_the_request_context(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    """`user`, the client's request id and the tier reach the row through the consumer; an
    event from a gateway older than those fields (published without them) stores the defaults."""
    bus = MemoryBus()
    consumer = UsageConsumer(bus, migrated_db, "c1")
    await consumer.start()
    try:
        await bus.publish(
            USAGE,
            UsageRecord(
                request_id="req_ctx", org_id="org_a", model="m", user="end-user-7 ✓",
                client_request_id="cli-42", service_tier="flex",
            ),
        )  # fmt: skip
        await bus.publish(USAGE, {"request_id": "req_old", "org_id": "org_a", "model": "m"})
        for _ in range(100):
            async with migrated_db() as s:
                rows = (await s.execute(select(UsageEvent).order_by(UsageEvent.request_id))).scalars().all()
            if len(rows) == 2:
                break
            await asyncio.sleep(0.05)
        got = {r.request_id: (r.user, r.client_request_id, r.service_tier) for r in rows}
        assert got == {"req_ctx": ("end-user-7 ✓", "cli-42", "flex"), "req_old": (None, None, "default")}
    finally:
        await consumer.stop()
        await bus.close()


async def test_ledger_keeps_the_batch_id(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    """A request run as a line of a batch names its batch in the ledger (which prices it at
    the batch discount); others, and events from gateways that predate batches, name none."""
    bus = MemoryBus()
    consumer = UsageConsumer(bus, migrated_db, "c1")
    await consumer.start()
    try:
        batch_id = "batch_" + "f" * 58  # as long as the column allows
        await bus.publish(
            USAGE, UsageRecord(request_id="req_line", org_id="org_a", model="m", batch_id=batch_id)
        )
        await bus.publish(USAGE, UsageRecord(request_id="req_online", org_id="org_a", model="m"))
        await bus.publish(USAGE, {"request_id": "req_old", "org_id": "org_a", "model": "m"})
        for _ in range(100):
            async with migrated_db() as s:
                rows = (await s.execute(select(UsageEvent).order_by(UsageEvent.request_id))).scalars().all()
            if len(rows) == 3:
                break
            await asyncio.sleep(0.05)
        assert {r.request_id: r.batch_id for r in rows} == {
            "req_line": batch_id,
            "req_old": None,
            "req_online": None,
        }
    finally:
        await consumer.stop()
        await bus.close()
    # Redelivered with the batch: still one row, still its batch.
    async with migrated_db() as s, s.begin():
        again = UsageRecord(request_id="req_line", org_id="org_a", model="m", batch_id=batch_id)
        assert await record_usage(s, [again]) == 0
    async with migrated_db() as s:
        assert (
            await s.scalar(select(UsageEvent.batch_id).where(UsageEvent.request_id == "req_line")) == batch_id
        )
