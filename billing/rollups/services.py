"""Hourly rollups: what each organisation used of each meter in each UTC hour, priced.

Tokens come from the ledger (those of batch requests on meters of their own, at the batch
discount), GPU-seconds of dedicated deployments from the workers' lifetimes; each is priced
at the price version in effect when it was used (dedicated deployments by GPU-hour only,
their tokens metered but free). Recomputing a range changes nothing the second time.
Invoices are built from these rows, and so is the dashboard's spend.

The ledger's tokens are priced one way (billing/prices/services.py): at the version in
effect when they were used (`charged_price`; free on dedicated deployments), each meter at
its unit price (`meter_price`, batch meters at the batch discount). Grouped by hour here;
per time bucket, model name and API key in `billing.rollups.usage` (the usage breakdown and
the spend of a key or model, which the rollups cannot give: they are per organisation and
base model); row by row for the usage export (`PriceHistory`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from itertools import pairwise
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    bindparam,
    cast,
    delete,
    extract,
    func,
    literal_column,
    select,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from billing.common import (
    BILLIONTH,
    EPOCH,
    HOUR,
    PER,
    as_utc,
    bucket_edges,
    ceil_hour,
    dialect,
    dialect_insert,
    floor_hour,
    per_bucket,
)
from billing.models import Price, UsageEvent, UsageRollup
from billing.prices.services import charged_price, meter_price, price_at, token_quantities
from control_plane.catalog.models import Deployment, Model, Worker
from tokenmill.db import utcnow
from tokenmill.errors import APIError

MAX_ROLLUP_RANGE = timedelta(days=400)

# org, hour, deployment, model, adapter, meter, price version: one row of `usage_rollups`.
RollupKey = tuple[str, datetime, str, str, str, str, str]
KEY_COLUMNS = ("org_id", "hour", "deployment_id", "model", "adapter", "meter", "price_id")
VALUE_COLUMNS = ("quantity", "unit_price", "amount", "currency", "computed_at")


@dataclass(slots=True)
class RollupRow:
    key: RollupKey
    quantity: Decimal
    unit_price: Decimal
    currency: str

    @property
    def meter(self) -> str:
        return self.key[5]

    @property
    def cost(self) -> Decimal:
        """Exact; stored to 1e-9 (`amount`), while invoices price the summed quantities."""
        return self.quantity * self.unit_price / PER[self.meter]

    def values(self) -> tuple[Decimal, Decimal, Decimal, str]:
        return self.quantity, self.unit_price, self.cost.quantize(BILLIONTH, ROUND_HALF_EVEN), self.currency


def _add(rows: dict[RollupKey, RollupRow], key: RollupKey, quantity: Decimal, price: Price | None) -> None:
    row = rows.get(key)
    if row is None:
        currency = price.currency if price is not None else "usd"
        rows[key] = RollupRow(key, quantity, meter_price(price, key[5]), currency)
    else:
        row.quantity += quantity


async def price_changes(
    session: AsyncSession, subject: ColumnElement[bool], start: datetime, end: datetime
) -> list[datetime]:
    """Moments inside (start, end) at which some price version starts: between two of them
    every price is constant, so usage can be summed in SQL and priced once per stretch."""
    found = await session.scalars(
        select(Price.effective_from).where(subject, Price.effective_from > start, Price.effective_from < end)
    )
    return sorted({as_utc(t) for t in found})


def _hour_index(session: AsyncSession, column: Any) -> ColumnElement[int]:
    """Whole hours since the epoch of a timestamp, in SQL. Literal constants rather than
    bound parameters, so PostgreSQL sees the same expression in SELECT and GROUP BY."""
    if dialect(session) == "postgresql":
        return cast(func.floor(extract("epoch", column) / literal_column("3600")), BigInteger)
    # SQLite keeps UTC times as text; strftime('%s') reads them as epoch seconds.
    return cast(func.strftime(literal_column("'%s'"), column), Integer).op("/")(literal_column("3600"))


async def _token_usage(
    session: AsyncSession,
    rows: dict[RollupKey, RollupRow],
    start: datetime,
    end: datetime,
    org_id: str | None,
) -> None:
    """The ledger's tokens in [start, end) by organisation, hour, deployment, adapter and
    meter, at the model price in effect when they were used. Requests run in a batch go to
    the batch meters, at the price version's batch discount."""
    hour = _hour_index(session, UsageEvent.created_at).label("h")
    model_name = func.coalesce(Model.name, UsageEvent.model)
    batch = UsageEvent.batch_id.is_not(None).label("batch")
    group = (
        UsageEvent.org_id,
        hour,
        UsageEvent.deployment_id,
        Deployment.model_id,
        Deployment.type,
        model_name,
        UsageEvent.adapter,
        batch,
    )
    prices: dict[tuple[str, datetime], Price | None] = {}
    edges = [start, *await price_changes(session, Price.model_id.is_not(None), start, end), end]
    for lo, hi in pairwise(edges):
        stmt = (
            select(
                *group,
                func.sum(UsageEvent.prompt_tokens),
                func.sum(UsageEvent.cached_tokens),
                func.sum(UsageEvent.completion_tokens),
            )
            .select_from(UsageEvent)
            .outerjoin(Deployment, Deployment.id == UsageEvent.deployment_id)
            .outerjoin(Model, Model.id == Deployment.model_id)
            .where(UsageEvent.created_at >= lo, UsageEvent.created_at < hi)
            .group_by(*group)
        )
        if org_id is not None:
            stmt = stmt.where(UsageEvent.org_id == org_id)
        for row in await session.execute(stmt):
            org, h, dep_id, model_id, dep_type, model, adapter, in_batch, prompt, cached, output = row
            price = await charged_price(session, prices, model_id, dep_type, lo)
            at = EPOCH + int(h) * HOUR
            prompt, cached, output = int(prompt or 0), int(cached or 0), int(output or 0)
            for meter, quantity in token_quantities(prompt, cached, output, batch=bool(in_batch)):
                if quantity:
                    key = (org, at, dep_id or "", model, adapter or "", meter, price.id if price else "")
                    _add(rows, key, Decimal(quantity), price)


def _seconds(delta: timedelta) -> Decimal:
    """A duration as exact seconds (timedelta keeps microseconds as integers)."""
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 1_000_000


async def _gpu_usage(
    session: AsyncSession,
    rows: dict[RollupKey, RollupRow],
    start: datetime,
    end: datetime,
    org_id: str | None,
) -> None:
    """GPU-seconds of dedicated deployments in [start, end): each worker's lifetime (start to
    stop; to its last heartbeat when it was lost or is still running, so no unseen time is
    ever billed) times the GPUs it held (its deployment's gpus_per_replica when it joined),
    clipped to each hour and priced at the GPU-hour price then in effect."""
    until = func.coalesce(Worker.stopped_at, Worker.last_seen_at, Worker.started_at)
    stmt = (
        select(
            Worker.started_at,
            Worker.stopped_at,
            Worker.last_seen_at,
            Worker.gpu_type,
            Worker.gpus,
            Deployment.id,
            Deployment.org_id,
            Deployment.gpu_type,
            Model.name,
        )
        .join(Deployment, Deployment.id == Worker.deployment_id)
        .join(Model, Model.id == Deployment.model_id)
        .where(
            Deployment.type == "dedicated",
            Deployment.org_id.is_not(None),
            Worker.started_at < end,
            until > start,
        )
    )
    if org_id is not None:
        stmt = stmt.where(Deployment.org_id == org_id)
    lifetimes = (await session.execute(stmt)).all()
    if not lifetimes:
        return
    changes = await price_changes(session, Price.gpu_type.is_not(None), start, end)
    prices: dict[tuple[str, datetime], Price | None] = {}
    for started, stopped, seen, worker_gpu, gpus, dep_id, org, dep_gpu, model in lifetimes:
        lo = max(as_utc(started), start)
        hi = min(as_utc(stopped or seen or started), end)
        gpu = dep_gpu or worker_gpu or ""
        t = lo
        while t < hi:
            # The next cut: the hour's end, a price change, or the lifetime's end.
            nxt = min([floor_hour(t) + HOUR, hi, *(c for c in changes if c > t)])
            # Which stretch between price changes `t` is in decides the price.
            stretch = max((c for c in changes if c <= t), default=start)
            if (gpu, stretch) not in prices:
                prices[gpu, stretch] = await price_at(session, gpu_type=gpu, at=t) if gpu else None
            price = prices[gpu, stretch]
            key = (org, floor_hour(t), dep_id, model, "", "gpu_seconds", price.id if price else "")
            _add(rows, key, _seconds(nxt - t) * gpus, price)
            t = nxt


async def compute_rollups(
    session: AsyncSession, start: datetime, end: datetime, *, org_id: str | None = None
) -> dict[RollupKey, RollupRow]:
    """What `usage_rollups` should hold for usage in [start, end), without writing it."""
    rows: dict[RollupKey, RollupRow] = {}
    start, end = as_utc(start), as_utc(end)
    await _token_usage(session, rows, start, end, org_id)
    await _gpu_usage(session, rows, start, end, org_id)
    return rows


@dataclass(slots=True)
class RollupStats:
    start: datetime
    end: datetime
    rows: int = 0  # rows the range holds now
    inserted: int = 0
    updated: int = 0
    deleted: int = 0


async def store_rollups(session: AsyncSession, start: datetime, end: datetime) -> RollupStats:
    """Recompute the rollups of the whole hours covering [start, end): insert new rows,
    update changed ones, delete ones whose usage is gone. A rerun writes nothing.

    Concurrent runs over the same hours are safe: the upsert on the unique key makes the
    later one update what the earlier one inserted.
    """
    start, end = floor_hour(start), ceil_hour(end)
    if end - start > MAX_ROLLUP_RANGE:
        raise APIError(400, "Roll up at most 400 days at once.", param="to")
    computed = await compute_rollups(session, start, end)
    stats = RollupStats(start, end, rows=len(computed))
    existing: dict[RollupKey, tuple[int, tuple[Decimal, Decimal, Decimal, str]]] = {}
    result = await session.stream(
        select(
            UsageRollup.id,
            *(getattr(UsageRollup, c) for c in KEY_COLUMNS),
            UsageRollup.quantity,
            UsageRollup.unit_price,
            UsageRollup.amount,
            UsageRollup.currency,
        )
        .where(UsageRollup.hour >= start, UsageRollup.hour < end)
        .execution_options(yield_per=5000)
    )
    async for part in result.partitions():
        for row in part:
            key = (row[1], as_utc(row[2]), *row[3:8])
            existing[key] = (row[0], tuple(row[8:12]))  # type: ignore[assignment]
    stale = [row_id for key, (row_id, _) in existing.items() if key not in computed]
    changed = [r for key, r in computed.items() if key not in existing or existing[key][1] != r.values()]
    for chunk in _chunks(stale, 500):
        await session.execute(delete(UsageRollup).where(UsageRollup.id.in_(chunk)))
    now = utcnow()
    for chunk in _chunks(changed, 500):
        values = [
            dict(zip(KEY_COLUMNS, r.key, strict=True))
            | dict(zip(("quantity", "unit_price", "amount", "currency"), r.values(), strict=True))
            | {"computed_at": now}
            for r in chunk
        ]
        stmt = dialect_insert(session)(UsageRollup).values(values)
        stmt = stmt.on_conflict_do_update(
            index_elements=list(KEY_COLUMNS),
            set_={c: stmt.excluded[c] for c in VALUE_COLUMNS},
        )
        await session.execute(stmt)
    stats.deleted = len(stale)
    stats.inserted = sum(1 for r in changed if r.key not in existing)
    stats.updated = len(changed) - stats.inserted
    return stats


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


async def spend_since(session: AsyncSession, org_id: str, since: datetime) -> Decimal:
    """What an organisation's usage since `since` costs, exactly (unrounded): tokens at the
    prices in effect when they were used, dedicated deployments by GPU time. Seeds the
    gateway's month-to-date budget counter; the same arithmetic as the rollups."""
    # A day ahead: events stamped by a gateway whose clock runs ahead of ours count too.
    rows = await compute_rollups(session, since, utcnow() + timedelta(days=1), org_id=org_id)
    return sum((r.cost for r in rows.values()), Decimal(0))


# --- spend over time ------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _spend_stmt(n: int, by_org: bool) -> Any:
    filters = [UsageRollup.org_id == bindparam("org_id")] if by_org else []

    def one(i: Any) -> Any:
        return (
            select(i, UsageRollup.currency, func.sum(UsageRollup.amount))
            .where(*filters)
            .group_by(UsageRollup.currency)
        )

    return per_bucket(UsageRollup.hour, n, one)


async def spend_per_bucket(
    session: AsyncSession, starts: Sequence[datetime], end: datetime, org_id: str | None
) -> tuple[str, list[Decimal]]:
    """What was spent in each bucket [starts[i], starts[i + 1]) (the last one ends at `end`),
    from the rollups: only in the currency with most of the spend (one chart has one unit),
    which is returned with it ("usd" when nothing was spent)."""
    stmt = _spend_stmt(len(starts), org_id is not None)
    params = bucket_edges(starts, end) | {"org_id": org_id}
    rows = [(int(i), c, Decimal(str(a or 0))) for i, c, a in await session.execute(stmt, params)]
    per_currency: dict[str, Decimal] = {}
    for _, currency, amount in rows:
        per_currency[currency] = per_currency.get(currency, Decimal(0)) + amount
    currency = main_currency(per_currency)
    spend = [Decimal(0) for _ in starts]
    for i, cur, amount in rows:
        if cur == currency:
            spend[i] += amount
    return currency, spend


def main_currency(amounts: dict[str, Decimal]) -> str:
    """The currency with most of the spend (one chart has one unit); "usd" when none."""
    return max(amounts, key=lambda c: amounts[c]) if amounts else "usd"
