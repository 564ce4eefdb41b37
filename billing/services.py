"""Billing logic: the price book, the usage ledger, hourly rollups, invoices and exports.

Money rules (DESIGN.md): `Decimal` throughout; input tokens billed = prompt - cached at the
input price, cached tokens at the cached-input price, output tokens at the output price;
each invoice line rounded half-even to the cent (and nothing rounded before that);
dedicated deployments billed by GPU-hour only, their tokens not charged per token.

The flow: usage events -> `usage_events` (the ledger, once per request id) -> hourly
`usage_rollups` (with the workers' lifetimes for GPU time, priced at the price in effect
when the usage happened) -> monthly `invoices`. Each step can be rerun and changes nothing
the second time. The periodic entry points taking a sessionmaker are in billing/jobs.py.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from itertools import pairwise
from typing import Any

import msgspec
from sqlalchemy import BigInteger, Integer, cast, delete, extract, func, literal_column, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload
from sqlalchemy.sql.elements import ColumnElement

from billing.models import METERS, Invoice, InvoiceLine, Price, UsageEvent, UsageRollup
from control_plane.models import Adapter, Deployment, Model, Worker
from tokenmill.bus import Entry, EventBus
from tokenmill.db import new_id, utcnow
from tokenmill.errors import APIError
from tokenmill.protocol import USAGE, UsageRecord
from tokenmill.tasks import GroupConsumer

log = logging.getLogger("tokenmill.billing")


MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)
CENT = Decimal("0.01")
NANO = Decimal("1e-9")
HOUR = timedelta(hours=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# What one unit price is per: a million tokens, or an hour of GPU time.
PER = {"input": MILLION, "cached_input": MILLION, "output": MILLION, "gpu_seconds": SECONDS_PER_HOUR}
TOKEN_METERS = ("input", "cached_input", "output")
# The most a price may be: what its column (Numeric(18, 9)) holds.
MAX_PRICE = Decimal(10) ** 9
CURRENCY = re.compile(r"^[a-z]{3}$")
MAX_ROLLUP_RANGE = timedelta(days=400)


# --- time -------------------------------------------------------------------------------


def as_utc(t: datetime) -> datetime:
    """Naive times are UTC (as the database stores them)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def floor_hour(t: datetime) -> datetime:
    return as_utc(t).replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: datetime) -> datetime:
    floor = floor_hour(t)
    return floor if floor == as_utc(t) else floor + HOUR


def month_bounds(month: date | datetime | str) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of a UTC calendar month, given as a
    date or time in it, or as `YYYY-MM`. A malformed string is a 400 naming `month`."""
    if isinstance(month, str):
        m = re.fullmatch(r"(\d{4})-(\d{2})(?:-01)?", month.strip())
        if m is None or not 1 <= int(m.group(2)) <= 12:
            raise APIError(400, f"month must look like 2026-11, not {month!r}.", param="month")
        year, mon = int(m.group(1)), int(m.group(2))
    elif isinstance(month, datetime):
        t = as_utc(month)
        year, mon = t.year, t.month
    else:
        year, mon = month.year, month.month
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=UTC)
    return start, end


def parse_time(value: str, param: str) -> datetime:
    """A time parameter: `2026-11-01T12:00:00Z`, `2026-11-01` (midnight) or `2026-11` (the
    month's start); naive means UTC. Anything else is a 400 naming `param`."""
    text = value.strip()
    if re.fullmatch(r"\d{4}-\d{2}", text):
        try:
            return month_bounds(text)[0]
        except APIError:
            pass
    else:
        try:
            return as_utc(datetime.fromisoformat(text.replace("z", "Z")))
        except ValueError:
            pass
    raise APIError(
        400,
        f"{param} must be an ISO 8601 date or time (e.g. 2026-11-01 or 2026-11-01T00:00:00Z), not {value!r}.",
        param=param,
    )


def time_range(
    start: str | None,
    end: str | None,
    *,
    now: datetime | None = None,
    names: tuple[str, str] = ("from", "to"),
) -> tuple[datetime, datetime]:
    """A [start, end) range from optional parameters: by default this month so far."""
    now = now or utcnow()
    lo = parse_time(start, names[0]) if start else month_bounds(now)[0]
    hi = parse_time(end, names[1]) if end else now
    if hi <= lo:
        raise APIError(400, f"{names[1]} must be after {names[0]}.", param=names[1])
    return lo, hi


def _seconds(delta: timedelta) -> Decimal:
    """A duration as exact seconds (timedelta keeps microseconds as integers)."""
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 1_000_000


def _dialect(session: AsyncSession) -> str:
    return session.get_bind().dialect.name


def _insert(session: AsyncSession) -> Any:
    """The dialect's INSERT, which has ON CONFLICT (both PostgreSQL and SQLite)."""
    return postgresql.insert if _dialect(session) == "postgresql" else sqlite.insert


def _num(d: Decimal) -> str:
    """A quantity or price without the column's trailing zeros, never in exponent form."""
    text = format(d.normalize(), "f")
    return "0" if text in ("-0", "") else text


def cents(amount: Decimal) -> Decimal:
    """The one rounding of the money rules: half-even to the cent."""
    return amount.quantize(CENT, rounding=ROUND_HALF_EVEN)


# --- prices -----------------------------------------------------------------------------


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


async def price_at(
    session: AsyncSession, *, model_id: str | None = None, gpu_type: str | None = None, at: datetime
) -> Price | None:
    """The version of a model's (or GPU type's) price in effect at `at`: the newest one
    whose `effective_from` is not after it."""
    subject = Price.model_id == model_id if model_id is not None else Price.gpu_type == gpu_type
    return await session.scalar(
        select(Price)
        .where(subject, Price.effective_from <= at)
        .order_by(Price.effective_from.desc())
        .limit(1)
    )


async def model_rates(session: AsyncSession, model_id: str, at: datetime | None = None) -> Rates:
    """The price of a model in effect at `at` (default now)."""
    price = await price_at(session, model_id=model_id, at=at or utcnow())
    if price is None:
        return FREE
    return Rates(price.input_per_mtok, price.cached_input_per_mtok, price.output_per_mtok, price.currency)


def _unit_price(price: Price | None, meter: str) -> Decimal:
    if price is None:
        return Decimal(0)
    return {
        "input": price.input_per_mtok,
        "cached_input": price.cached_input_per_mtok,
        "output": price.output_per_mtok,
        "gpu_seconds": price.gpu_hour,
    }[meter]


def _check_price(value: Decimal, param: str) -> Decimal:
    try:
        ok = value.is_finite() and 0 <= value < MAX_PRICE and value == value.quantize(NANO)
    except InvalidOperation:
        ok = False
    if not ok:
        raise APIError(
            400, f"{param} must be a non-negative amount below 10^9 with at most 9 decimals.", param=param
        )
    return value


def _check_currency(value: str) -> str:
    currency = value.strip().lower()
    if not CURRENCY.match(currency):
        raise APIError(400, "currency must be a three-letter ISO 4217 code, e.g. usd.", param="currency")
    return currency


class PriceBook:
    """Adds and reads price versions; never edits one in place."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def _model(self, ref: str) -> Model:
        model = await self.session.scalar(select(Model).where(or_(Model.id == ref, Model.name == ref)))
        if model is None:
            raise APIError(400, f"No model '{ref}' in the catalogue.", param="model")
        return model

    async def _check_effective(self, subject: ColumnElement[bool], effective_from: datetime) -> None:
        # A version starting inside an invoiced period would reprice usage that is already on
        # a finalized (immutable) invoice: rollups and invoices would disagree for ever.
        closed = await self.session.scalar(
            select(func.max(Invoice.period_end)).where(Invoice.status == "finalized")
        )
        if closed is not None and effective_from < as_utc(closed):
            raise APIError(
                409,
                f"effective_from must not be before {as_utc(closed).isoformat()}: usage before it "
                "is on finalized invoices.",
                param="effective_from",
            )
        clash = await self.session.scalar(
            select(Price.id).where(subject, Price.effective_from == effective_from)
        )
        if clash is not None:
            raise APIError(
                409,
                f"A price version effective from {effective_from.isoformat()} already exists "
                f"({clash}); add one with a later effective_from instead.",
                param="effective_from",
            )

    async def add_model_price(
        self,
        *,
        model_ref: str,
        input_per_mtok: Decimal,
        output_per_mtok: Decimal,
        cached_input_per_mtok: Decimal | None = None,
        currency: str = "usd",
        effective_from: datetime | None = None,
    ) -> tuple[Price, Model]:
        """A new price version of a model; without a cached-input price, cached tokens cost
        as much as uncached ones."""
        model = await self._model(model_ref)
        when = as_utc(effective_from) if effective_from else utcnow()
        price = Price(
            model_id=model.id,
            currency=_check_currency(currency),
            input_per_mtok=_check_price(input_per_mtok, "input_per_mtok"),
            cached_input_per_mtok=_check_price(
                input_per_mtok if cached_input_per_mtok is None else cached_input_per_mtok,
                "cached_input_per_mtok",
            ),
            output_per_mtok=_check_price(output_per_mtok, "output_per_mtok"),
            effective_from=when,
        )
        await self._check_effective(Price.model_id == model.id, when)
        self.session.add(price)
        await self.session.flush()
        return price, model

    async def add_gpu_price(
        self,
        *,
        gpu_type: str,
        per_hour: Decimal,
        currency: str = "usd",
        effective_from: datetime | None = None,
    ) -> Price:
        gpu = gpu_type.strip()
        if not gpu or len(gpu) > 50:
            raise APIError(400, "gpu_type must be 1 to 50 characters.", param="gpu_type")
        when = as_utc(effective_from) if effective_from else utcnow()
        price = Price(
            gpu_type=gpu,
            currency=_check_currency(currency),
            gpu_hour=_check_price(per_hour, "per_hour"),
            effective_from=when,
        )
        await self._check_effective(Price.gpu_type == gpu, when)
        self.session.add(price)
        await self.session.flush()
        return price

    async def model_prices(
        self, *, model_ref: str | None = None, at: datetime | None = None
    ) -> list[tuple[Price, Model]]:
        """Every version (oldest first per model), or with `at` the one in effect then."""
        stmt = select(Price, Model).join(Model, Model.id == Price.model_id)
        if model_ref is not None:
            stmt = stmt.where(Price.model_id == (await self._model(model_ref)).id)
        if at is not None:
            stmt = stmt.where(Price.effective_from <= at)
        found = await self.session.execute(stmt.order_by(Model.name, Price.effective_from))
        rows = [(p, m) for p, m in found]
        if at is not None:
            rows = list({m.id: (p, m) for p, m in rows}.values())  # the last version of each wins
        return rows

    async def gpu_prices(self, *, gpu_type: str | None = None, at: datetime | None = None) -> list[Price]:
        stmt = select(Price).where(Price.gpu_type.is_not(None))
        if gpu_type is not None:
            stmt = stmt.where(Price.gpu_type == gpu_type)
        if at is not None:
            stmt = stmt.where(Price.effective_from <= at)
        rows = list(await self.session.scalars(stmt.order_by(Price.gpu_type, Price.effective_from)))
        if at is not None:
            rows = list({p.gpu_type: p for p in rows}.values())
        return rows


# --- the ledger -------------------------------------------------------------------------


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


# PostgreSQL: a whole batch as one array per column, through one fixed statement (prepared
# once per connection; no per-batch SQL compilation or thirteen binds per row).
_LEDGER_COLUMNS = (
    ("request_id", "varchar"),
    ("org_id", "varchar"),
    ("api_key_id", "varchar"),
    ("model", "varchar"),
    ("adapter", "varchar"),
    ("deployment_id", "varchar"),
    ("prompt_tokens", "int4"),
    ("cached_tokens", "int4"),
    ("completion_tokens", "int4"),
    ("ttft_ms", "float8"),
    ("duration_ms", "float8"),
    ("status", "varchar"),
    ("created_at", "timestamptz"),
)
_LEDGER_INSERT = text(
    f"INSERT INTO usage_events ({', '.join(c for c, _ in _LEDGER_COLUMNS)}) "
    f"SELECT * FROM unnest({', '.join(f'CAST(:{c} AS {t}[])' for c, t in _LEDGER_COLUMNS)}) "
    "ON CONFLICT (request_id) DO NOTHING"
)


def _columns(records: list[UsageRecord]) -> dict[str, list[Any]]:
    """The batch column-wise, as `_row` would store each record."""
    now = utcnow()
    fromtimestamp = datetime.fromtimestamp
    return {
        "request_id": [r.request_id for r in records],
        "org_id": [r.org_id for r in records],
        "api_key_id": [r.api_key_id for r in records],
        "model": [r.model for r in records],
        "adapter": [r.adapter for r in records],
        "deployment_id": [r.deployment_id for r in records],
        "prompt_tokens": [r.prompt_tokens for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "completion_tokens": [r.completion_tokens for r in records],
        "ttft_ms": [r.ttft_ms for r in records],
        "duration_ms": [r.duration_ms for r in records],
        "status": [r.status for r in records],
        "created_at": [fromtimestamp(r.ts, UTC) if r.ts else now for r in records],
    }


async def record_usage(session: AsyncSession, records: list[UsageRecord]) -> int:
    """Insert records, skipping request ids already in the ledger. Returns rows inserted."""
    if not records:
        return 0
    if _dialect(session) == "postgresql":
        result = await session.execute(_LEDGER_INSERT, _columns(records))
        return result.rowcount or 0  # type: ignore[attr-defined]
    stmt = (
        _insert(session)(UsageEvent)
        .values([_row(r) for r in records])
        .on_conflict_do_nothing(index_elements=["request_id"])
    )
    result = await session.execute(stmt)
    return result.rowcount or 0  # type: ignore[attr-defined]


class UsageConsumer(GroupConsumer):
    """Usage events into the ledger. Acks follow the commit, so a crash between the two
    re-delivers and the unique request id absorbs the duplicate."""

    name = "usage-consumer"
    stream = USAGE
    group = "billing-ledger"
    # Events per batch (one transaction, then one XACK): 2000 measured 1.1-1.5x the events/s
    # of 500 (bench/billing.py); a failed batch is redelivered whole, which the ledger absorbs.
    count = 2000

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


# --- rollups ----------------------------------------------------------------------------

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
        return self.quantity, self.unit_price, self.cost.quantize(NANO, ROUND_HALF_EVEN), self.currency


def _add(rows: dict[RollupKey, RollupRow], key: RollupKey, quantity: Decimal, price: Price | None) -> None:
    row = rows.get(key)
    if row is None:
        currency = price.currency if price is not None else "usd"
        rows[key] = RollupRow(key, quantity, _unit_price(price, key[5]), currency)
    else:
        row.quantity += quantity


async def _price_changes(
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
    if _dialect(session) == "postgresql":
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
    meter, at the model price in effect when they were used."""
    hour = _hour_index(session, UsageEvent.created_at).label("h")
    model_name = func.coalesce(Model.name, UsageEvent.model)
    group = (
        UsageEvent.org_id,
        hour,
        UsageEvent.deployment_id,
        Deployment.model_id,
        Deployment.type,
        model_name,
        UsageEvent.adapter,
    )
    prices: dict[tuple[str, datetime], Price | None] = {}
    edges = [start, *await _price_changes(session, Price.model_id.is_not(None), start, end), end]
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
            org, h, dep_id, model_id, dep_type, model, adapter, prompt, cached, output = row
            price = None
            # Dedicated deployments are paid by the GPU-hour: their tokens are metered, free.
            if model_id is not None and dep_type != "dedicated":
                if (model_id, lo) not in prices:
                    prices[model_id, lo] = await price_at(session, model_id=model_id, at=lo)
                price = prices[model_id, lo]
            at = EPOCH + int(h) * HOUR
            prompt, cached, output = int(prompt or 0), int(cached or 0), int(output or 0)
            for meter, quantity in (("input", prompt - cached), ("cached_input", cached), ("output", output)):
                if quantity:
                    key = (org, at, dep_id or "", model, adapter or "", meter, price.id if price else "")
                    _add(rows, key, Decimal(quantity), price)


async def _gpu_usage(
    session: AsyncSession,
    rows: dict[RollupKey, RollupRow],
    start: datetime,
    end: datetime,
    org_id: str | None,
) -> None:
    """GPU-seconds of dedicated deployments in [start, end): each worker's lifetime (start to
    stop; to its last heartbeat when it was lost or is still running, so no unseen time is
    ever billed), clipped to each hour and priced at the GPU-hour price then in effect."""
    until = func.coalesce(Worker.stopped_at, Worker.last_seen_at, Worker.started_at)
    stmt = (
        select(
            Worker.started_at,
            Worker.stopped_at,
            Worker.last_seen_at,
            Worker.gpu_type,
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
    changes = await _price_changes(session, Price.gpu_type.is_not(None), start, end)
    prices: dict[tuple[str, datetime], Price | None] = {}
    for started, stopped, seen, worker_gpu, dep_id, org, dep_gpu, model in lifetimes:
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
            _add(rows, key, _seconds(nxt - t), price)
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
        stmt = _insert(session)(UsageRollup).values(values)
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


# --- invoices ---------------------------------------------------------------------------

METER_LABELS = {
    "input": "input tokens",
    "cached_input": "cached input tokens",
    "output": "output tokens",
    "gpu_seconds": "GPU time",
}
# A transaction-scoped PostgreSQL advisory lock serializing invoice numbering.
NUMBERING_LOCK = 0x746D_696E_76  # "tminv"


def invoice_number(number: int | None) -> str | None:
    return None if number is None else f"TM-{number:06d}"


@dataclass(slots=True, frozen=True)
class LineDraft:
    """An invoice line before it is stored; compared field by field to the stored one."""

    position: int
    description: str
    meter: str
    model: str
    deployment_id: str
    adapter: str
    quantity: Decimal
    unit_price: Decimal
    amount: Decimal

    @classmethod
    def of(cls, line: InvoiceLine) -> LineDraft:
        return cls(
            line.position,
            line.description,
            line.meter,
            line.model,
            line.deployment_id,
            line.adapter,
            line.quantity,
            line.unit_price,
            line.amount,
        )


@dataclass(slots=True)
class InvoiceBuild:
    month: str
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # drafts whose usage is gone
    finalized: list[str] = field(default_factory=list)  # left alone: immutable


# deployment, model, adapter, meter, unit price: what one invoice line sums.
LineKey = tuple[str, str, str, str, Decimal]


def _line_order(key: LineKey) -> tuple[Any, ...]:
    """Token lines by model, adapter and meter; GPU time last."""
    dep, model, adapter, meter, unit_price = key
    return (meter == "gpu_seconds", model, adapter, dep, METERS.index(meter), unit_price)


async def _invoice_lines(
    session: AsyncSession, start: datetime, end: datetime, org_id: str | None
) -> dict[tuple[str, str], list[LineDraft]]:
    """Per (organisation, currency), the month's lines from the rollups: the quantities of
    each model x adapter x meter x unit price summed (as Decimals, in Python: SQLite would
    sum them as floats), each line priced and rounded half-even to the cent once."""
    # (org, currency) -> line key -> [quantity, one of the price versions it was used at]
    groups: dict[tuple[str, str], dict[LineKey, list[Any]]] = {}
    stmt = (
        select(
            UsageRollup.org_id,
            UsageRollup.currency,
            UsageRollup.deployment_id,
            UsageRollup.model,
            UsageRollup.adapter,
            UsageRollup.meter,
            UsageRollup.unit_price,
            UsageRollup.quantity,
            UsageRollup.price_id,
        )
        # What has no price (or a zero one) is metered but not invoiced.
        .where(UsageRollup.hour >= start, UsageRollup.hour < end, UsageRollup.unit_price > 0)
        .execution_options(yield_per=5000)
    )
    if org_id is not None:
        stmt = stmt.where(UsageRollup.org_id == org_id)
    result = await session.stream(stmt)
    async for part in result.partitions():
        for org, currency, dep, model, adapter, meter, unit_price, quantity, price_id in part:
            slot = groups.setdefault((org, currency), {}).setdefault(
                (dep, model, adapter, meter, unit_price), [Decimal(0), price_id]
            )
            slot[0] += quantity
    names = await _names(session, groups)
    out: dict[tuple[str, str], list[LineDraft]] = {}
    for (org, currency), lines in groups.items():
        ordered = sorted(lines.items(), key=lambda kv: _line_order(kv[0]))
        drafts = []
        for position, ((dep, model, adapter, meter, unit_price), (quantity, price_id)) in enumerate(ordered):
            drafts.append(
                LineDraft(
                    position=position,
                    description=_describe(names, currency, dep, model, adapter, meter, unit_price, price_id),
                    meter=meter,
                    model=model,
                    deployment_id=dep,
                    adapter=adapter,
                    quantity=quantity,
                    unit_price=unit_price,
                    amount=cents(quantity * unit_price / PER[meter]),
                )
            )
        out[org, currency] = drafts
    return out


async def _names(session: AsyncSession, groups: dict[Any, dict[LineKey, list[Any]]]) -> dict[str, str]:
    """Display names of the deployments and adapters, and GPU types of the prices, named
    in the lines (one query each)."""
    deps, adapters, prices = set(), set(), set()
    for lines in groups.values():
        for (dep, _m, adapter, meter, _u), (_q, price_id) in lines.items():
            if meter == "gpu_seconds":
                deps.add(dep)
                prices.add(price_id)
            if adapter:
                adapters.add(adapter)
    names: dict[str, str] = {}
    for ids, key, name in (
        (deps, Deployment.id, Deployment.name),
        (adapters, Adapter.id, Adapter.name),
        (prices, Price.id, Price.gpu_type),
    ):
        if ids:
            names.update((k, v) for k, v in await session.execute(select(key, name).where(key.in_(ids))))
    return names


def _describe(
    names: dict[str, str],
    currency: str,
    dep: str,
    model: str,
    adapter: str,
    meter: str,
    unit_price: Decimal,
    price_id: str,
) -> str:
    if meter == "gpu_seconds":
        gpu = names.get(price_id) or "GPU"
        return (
            f"Dedicated deployment {names.get(dep, dep)} ({model}, {gpu}): GPU time "
            f"at {_num(unit_price)} {currency} per GPU-hour"
        )
    on = f" with adapter {names.get(adapter, adapter)}" if adapter else ""
    return f"{model}{on}: {METER_LABELS[meter]} at {_num(unit_price)} {currency} per 1M tokens"


async def build_invoice_drafts(
    session: AsyncSession, month: date | datetime | str, *, org_id: str | None = None
) -> InvoiceBuild:
    """Create or refresh the month's draft invoices from the rollups; finalized invoices are
    never touched. A rerun with unchanged rollups changes nothing (not even `updated_at`)."""
    start, end = month_bounds(month)
    build = InvoiceBuild(start.strftime("%Y-%m"))
    wanted = await _invoice_lines(session, start, end, org_id)
    stmt = select(Invoice).options(selectinload(Invoice.lines)).where(Invoice.period_start == start)
    if org_id is not None:
        stmt = stmt.where(Invoice.org_id == org_id)
    locked = stmt.with_for_update().execution_options(populate_existing=True)
    existing = {(i.org_id, i.currency): i for i in await session.scalars(locked)}
    now = utcnow()
    for (org, currency), invoice in existing.items():
        if (org, currency) in wanted:
            continue
        if invoice.status == "finalized":
            build.finalized.append(invoice.id)
        else:  # a draft whose usage was all re-rated or removed
            await session.delete(invoice)
            build.deleted.append(invoice.id)
    for (org, currency), drafts in sorted(wanted.items()):
        invoice = existing.get((org, currency))
        if invoice is None:
            # ON CONFLICT DO NOTHING: a concurrent build may have created it a moment ago.
            inserted = await session.execute(
                _insert(session)(Invoice)
                .values(
                    id=new_id("inv"),
                    org_id=org,
                    period_start=start,
                    period_end=end,
                    currency=currency,
                    status="draft",
                    subtotal=Decimal(0),
                    total=Decimal(0),
                    created_at=now,
                    updated_at=now,
                )
                .on_conflict_do_nothing(index_elements=["org_id", "period_start", "currency"])
            )
            invoice = await session.scalar(
                select(Invoice)
                .options(selectinload(Invoice.lines))
                .where(Invoice.org_id == org, Invoice.period_start == start, Invoice.currency == currency)
                .with_for_update()
            )
            assert invoice is not None
            created = bool(inserted.rowcount)  # type: ignore[attr-defined]
            if created:
                build.created.append(invoice.id)
        else:
            created = False
        if invoice.status == "finalized":
            build.finalized.append(invoice.id)
            continue
        if [LineDraft.of(line) for line in invoice.lines] == drafts:
            if not created:
                build.unchanged.append(invoice.id)
            continue
        invoice.lines = [
            InvoiceLine(
                position=d.position,
                description=d.description,
                meter=d.meter,
                model=d.model,
                deployment_id=d.deployment_id,
                adapter=d.adapter,
                quantity=d.quantity,
                unit_price=d.unit_price,
                amount=d.amount,
            )
            for d in drafts
        ]
        invoice.subtotal = invoice.total = sum((d.amount for d in drafts), Decimal(0))
        invoice.updated_at = now
        if not created:
            build.updated.append(invoice.id)
    await session.flush()
    return build


async def finalize_invoice(
    session: AsyncSession, invoice_id: str, *, now: datetime | None = None, force: bool = False
) -> tuple[Invoice, bool]:
    """Finalize one draft as it stands: give it the next number and freeze it. Returns the
    invoice and whether this call finalized it (finalizing twice is a no-op).

    A month still running is refused unless `force`: its later usage would be on no invoice.
    """
    now = now or utcnow()
    # populate_existing: a copy loaded earlier in this session (before the lock) may be stale,
    # e.g. finalized meanwhile by another transaction; trusting it would number it twice.
    invoice = await session.scalar(
        select(Invoice)
        .options(selectinload(Invoice.lines))
        .where(Invoice.id == invoice_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if invoice is None:
        raise APIError(404, f"No invoice '{invoice_id}'.", code="not_found")
    if invoice.status == "finalized":
        return invoice, False
    if not force and as_utc(invoice.period_end) > now:
        raise APIError(
            409,
            f"The period of invoice {invoice.id} ends {as_utc(invoice.period_end).isoformat()}; "
            "finalize it after that (or with force=true, leaving later usage of the month uninvoiced).",
            code="period_not_over",
            param="force",
        )
    if _dialect(session) == "postgresql":
        # Numbers come from max + 1: concurrent finalizations take turns (SQLite has one
        # writer at a time anyway), and the unique constraint backs this up.
        await session.execute(select(func.pg_advisory_xact_lock(NUMBERING_LOCK)))
    last = await session.scalar(select(func.max(Invoice.number)))
    invoice.number = (last or 0) + 1
    invoice.status = "finalized"
    invoice.finalized_at = invoice.updated_at = now
    await session.flush()
    log.info("finalized invoice %s as %s", invoice.id, invoice_number(invoice.number))
    return invoice, True


async def get_invoice(session: AsyncSession, invoice_id: str, *, org_id: str | None = None) -> Invoice:
    """An invoice with its lines; `org_id` confines the lookup to one tenant (404 otherwise,
    so other tenants' invoice ids cannot be probed)."""
    stmt = select(Invoice).options(selectinload(Invoice.lines)).where(Invoice.id == invoice_id)
    if org_id is not None:
        stmt = stmt.where(Invoice.org_id == org_id)
    invoice = await session.scalar(stmt)
    if invoice is None:
        raise APIError(404, f"No invoice '{invoice_id}'.", code="not_found")
    return invoice


async def list_invoices(
    session: AsyncSession,
    *,
    org_id: str | None = None,
    month: str | None = None,
    status: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[Invoice]:
    """Newest period first, without lines."""
    stmt = select(Invoice)
    if org_id is not None:
        stmt = stmt.where(Invoice.org_id == org_id)
    if month is not None:
        stmt = stmt.where(Invoice.period_start == month_bounds(month)[0])
    if status is not None:
        if status not in ("draft", "finalized"):
            raise APIError(400, "status must be draft or finalized.", param="status")
        stmt = stmt.where(Invoice.status == status)
    stmt = stmt.order_by(Invoice.period_start.desc(), Invoice.org_id, Invoice.currency)
    return list(await session.scalars(stmt.limit(limit).offset(offset)))


# --- exports ----------------------------------------------------------------------------

EXPORTS = ("usage", "rollups", "invoices")
FORMATS = ("csv", "json")
CHUNK_BYTES = 64 * 1024
FETCH_ROWS = 1000  # rows per round trip of the server-side cursor

USAGE_COLUMNS = (
    "request_id",
    "created_at",
    "org_id",
    "api_key_id",
    "model",
    "adapter",
    "deployment_id",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
    "status",
)
ROLLUP_COLUMNS = (
    "hour",
    "org_id",
    "deployment_id",
    "model",
    "adapter",
    "meter",
    "quantity",
    "unit_price",
    "amount",
    "currency",
    "price_id",
)
INVOICE_COLUMNS = (
    "invoice_id",
    "number",
    "org_id",
    "period_start",
    "period_end",
    "status",
    "currency",
    "subtotal",
    "total",
    "finalized_at",
)
LINE_COLUMNS = (
    "position",
    "description",
    "meter",
    "model",
    "deployment_id",
    "adapter",
    "quantity",
    "unit_price",
    "amount",
)


@dataclass(slots=True, frozen=True)
class ExportQuery:
    what: str  # usage | rollups | invoices
    fmt: str  # csv | json
    start: datetime
    end: datetime
    org_id: str | None = None  # None: every organisation (platform admins only)

    @property
    def media_type(self) -> str:
        return "text/csv; charset=utf-8" if self.fmt == "csv" else "application/json"

    @property
    def filename(self) -> str:
        span = f"{self.start:%Y%m%dT%H%M%SZ}-{self.end:%Y%m%dT%H%M%SZ}"
        return f"{self.what}-{self.org_id or 'all'}-{span}.{self.fmt}"


def export_query(
    what: str,
    fmt: str | None,
    start: str | None,
    end: str | None,
    org_id: str | None,
    *,
    now: datetime | None = None,
) -> ExportQuery:
    """Validated export parameters (400 naming the parameter otherwise); by default this
    month so far, as CSV."""
    if what not in EXPORTS:
        raise APIError(400, f"Export one of {', '.join(EXPORTS)}, not {what!r}.", param="what")
    fmt = (fmt or "csv").lower()
    if fmt not in FORMATS:
        raise APIError(400, f"format must be csv or json, not {fmt!r}.", param="format")
    lo, hi = time_range(start, end, now=now)
    return ExportQuery(what, fmt, lo, hi, org_id)


def _iso(t: datetime | None) -> str | None:
    return None if t is None else as_utc(t).isoformat().replace("+00:00", "Z")


def _usage_stmt(q: ExportQuery) -> Any:
    stmt = select(*(getattr(UsageEvent, c) for c in USAGE_COLUMNS)).where(
        UsageEvent.created_at >= q.start, UsageEvent.created_at < q.end
    )
    if q.org_id is not None:
        stmt = stmt.where(UsageEvent.org_id == q.org_id)
    return stmt.order_by(UsageEvent.created_at, UsageEvent.id)


def _usage_cells(row: Sequence[Any]) -> tuple[Any, ...]:
    return (row[0], _iso(row[1]), *row[2:])


def _rollups_stmt(q: ExportQuery) -> Any:
    stmt = select(*(getattr(UsageRollup, c) for c in ROLLUP_COLUMNS)).where(
        UsageRollup.hour >= q.start, UsageRollup.hour < q.end
    )
    if q.org_id is not None:
        stmt = stmt.where(UsageRollup.org_id == q.org_id)
    return stmt.order_by(*(getattr(UsageRollup, c) for c in KEY_COLUMNS))


def _rollup_cells(row: Sequence[Any]) -> tuple[Any, ...]:
    hour, org, dep, model, adapter, meter, quantity, unit_price, amount, currency, price_id = row
    return (
        _iso(hour),
        org,
        dep or None,
        model,
        adapter or None,
        meter,
        _num(quantity),
        _num(unit_price),
        _num(amount),
        currency,
        price_id or None,
    )


def _invoices_stmt(q: ExportQuery) -> Any:
    """Invoices whose period starts in the range, one row per line (or one for an invoice
    without lines), in invoice then line order."""
    stmt = (
        select(
            Invoice.id,
            Invoice.number,
            Invoice.org_id,
            Invoice.period_start,
            Invoice.period_end,
            Invoice.status,
            Invoice.currency,
            Invoice.subtotal,
            Invoice.total,
            Invoice.finalized_at,
            *(getattr(InvoiceLine, c) for c in LINE_COLUMNS),
        )
        .outerjoin(InvoiceLine, InvoiceLine.invoice_id == Invoice.id)
        .where(Invoice.period_start >= q.start, Invoice.period_start < q.end)
    )
    if q.org_id is not None:
        stmt = stmt.where(Invoice.org_id == q.org_id)
    return stmt.order_by(Invoice.period_start, Invoice.org_id, Invoice.currency, InvoiceLine.position)


def _invoice_cells(row: Sequence[Any]) -> tuple[Any, ...]:
    inv_id, number, org, start, end, status, currency, subtotal, total, finalized = row[:10]
    position, description, meter, model, dep, adapter, quantity, unit_price, amount = row[10:]
    return (
        inv_id,
        invoice_number(number),
        org,
        _iso(start),
        _iso(end),
        status,
        currency,
        str(cents(subtotal)),
        str(cents(total)),
        _iso(finalized),
        position,
        description,
        meter,
        model,
        dep or None,
        adapter or None,
        None if quantity is None else _num(quantity),
        None if unit_price is None else _num(unit_price),
        None if amount is None else str(cents(amount)),
    )


EXPORT_SHAPES = {
    "usage": (_usage_stmt, _usage_cells, USAGE_COLUMNS),
    "rollups": (_rollups_stmt, _rollup_cells, ROLLUP_COLUMNS),
    "invoices": (_invoices_stmt, _invoice_cells, INVOICE_COLUMNS + tuple(f"line_{c}" for c in LINE_COLUMNS)),
}


async def _cells(session: AsyncSession, q: ExportQuery) -> AsyncIterator[tuple[Any, ...]]:
    """The export's rows from a server-side cursor (PostgreSQL) or a stepped SQLite cursor:
    never more than FETCH_ROWS of them in memory."""
    make_stmt, to_cells, _ = EXPORT_SHAPES[q.what]
    result = await session.stream(make_stmt(q).execution_options(yield_per=FETCH_ROWS))
    async for part in result.partitions():
        for row in part:
            yield to_cells(row)


async def stream_export(session: AsyncSession, q: ExportQuery) -> AsyncIterator[bytes]:
    """The export as CSV (a header, then one line per row) or JSON (an array of objects;
    invoices nest their lines), in chunks of about CHUNK_BYTES. Money and quantities are
    strings (exact decimals), times ISO 8601 in UTC."""
    columns = EXPORT_SHAPES[q.what][2]
    if q.fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        async for cells in _cells(session, q):
            writer.writerow(cells)
            if buf.tell() >= CHUNK_BYTES:
                yield buf.getvalue().encode()
                buf.seek(0)
                buf.truncate()
        yield buf.getvalue().encode()
        return
    encode = msgspec.json.Encoder().encode
    out = bytearray(b"[")
    first = True
    if q.what == "invoices":
        objects = _nest_invoices(_cells(session, q))
    else:
        objects = (dict(zip(columns, cells, strict=True)) async for cells in _cells(session, q))
    async for obj in objects:
        if not first:
            out += b","
        first = False
        out += encode(obj)
        if len(out) >= CHUNK_BYTES:
            yield bytes(out)
            out.clear()
    out += b"]\n"
    yield bytes(out)


async def _nest_invoices(rows: AsyncIterator[tuple[Any, ...]]) -> AsyncIterator[dict[str, Any]]:
    """Consecutive line rows of one invoice as one object with its `lines`."""
    current: dict[str, Any] | None = None
    async for cells in rows:
        head, line = cells[: len(INVOICE_COLUMNS)], cells[len(INVOICE_COLUMNS) :]
        if current is None or current["invoice_id"] != head[0]:
            if current is not None:
                yield current
            current = dict(zip(INVOICE_COLUMNS, head, strict=True)) | {"lines": []}
        if line[0] is not None:  # an invoice without lines has one row of NULLs
            current["lines"].append(dict(zip(LINE_COLUMNS, line, strict=True)))
    if current is not None:
        yield current
