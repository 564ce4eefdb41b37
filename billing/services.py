"""The price book and the usage ledger: events from the bus into `usage_events`, exactly once
per request id; what usage costs (DESIGN.md's money rules)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import Price, UsageEvent
from control_plane.models import Deployment
from tokenmill.bus import Entry, EventBus
from tokenmill.db import utcnow
from tokenmill.protocol import USAGE, UsageRecord
from tokenmill.tasks import GroupConsumer

log = logging.getLogger("tokenmill.billing")


MILLION = Decimal(1_000_000)


@dataclass(slots=True, frozen=True)
class Rates:
    """Per-million-token prices of one model."""

    input: Decimal = Decimal(0)
    cached_input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    currency: str = "usd"

    def cost(self, prompt: int, cached: int, completion: int) -> Decimal:
        """Exact cost (not rounded: rounding happens once per invoice line)."""
        return (
            (prompt - cached) * self.input + cached * self.cached_input + completion * self.output
        ) / MILLION

    def worst_case(self, prompt: int, max_completion: int) -> Decimal:
        """The most a request can cost: every allowed token generated, each prompt token at
        the dearer of the cached and uncached price."""
        return (prompt * max(self.input, self.cached_input) + max_completion * self.output) / MILLION


FREE = Rates()


async def model_rates(session: AsyncSession, model_id: str, at: datetime | None = None) -> Rates:
    """The price of a model in effect at `at` (default now): the newest effective price."""
    price = await session.scalar(
        select(Price)
        .where(Price.model_id == model_id, Price.effective_from <= (at or utcnow()))
        .order_by(Price.effective_from.desc())
        .limit(1)
    )
    if price is None:
        return FREE
    return Rates(price.input_per_mtok, price.cached_input_per_mtok, price.output_per_mtok, price.currency)


async def spend_since(session: AsyncSession, org_id: str, since: datetime) -> Decimal:
    """What an organisation's requests since `since` cost, from the ledger at current prices.

    Seeds the gateway's month-to-date budget counter. Hourly rollups (the billing issue)
    will let this read rollups up to the last full hour and the ledger only after it.
    """
    rows = await session.execute(
        select(
            Deployment.model_id,
            func.sum(UsageEvent.prompt_tokens),
            func.sum(UsageEvent.cached_tokens),
            func.sum(UsageEvent.completion_tokens),
        )
        .join(Deployment, Deployment.id == UsageEvent.deployment_id)
        .where(UsageEvent.org_id == org_id, UsageEvent.created_at >= since)
        .group_by(Deployment.model_id)
    )
    total = Decimal(0)
    for model_id, prompt, cached, completion in rows.all():
        rates = await model_rates(session, model_id)
        total += rates.cost(int(prompt or 0), int(cached or 0), int(completion or 0))
    return total


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
