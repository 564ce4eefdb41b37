"""Exports of the ledger, the refusal counts, the rollups and the invoices, as CSV or JSON.

Streamed from a database cursor in chunks, so any range takes bounded memory. Money and
quantities are written as strings (exact decimals), times as ISO 8601 in UTC. The admin
API, the CLI, the on-demand job and the dashboard's downloads all write through here, so
every door gives the same file.
"""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import as_utc, cents, iso, plain, time_range
from billing.invoices.services import invoice_number
from billing.models import Invoice, InvoiceLine, Refusal, UsageEvent, UsageRollup
from billing.prices.services import PriceHistory, token_cost
from billing.rollups.services import KEY_COLUMNS
from control_plane.catalog.models import Deployment
from tokenmill.errors import APIError

EXPORTS = ("usage", "refusals", "rollups", "invoices")
CellsFactory = Callable[[AsyncSession], Awaitable[Callable[[Sequence[Any]], tuple[Any, ...]]]]
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
    "user",
    "client_request_id",
    "service_tier",
    "batch_id",
    # What the request's tokens cost (exact, unrounded) at the price version in effect when it
    # ran, as the rollups price them; 0 and no currency when not charged (no price, or a
    # dedicated deployment, paid by the GPU-hour).
    "cost",
    "currency",
)
# Requests refused before any worker ran them (which the ledger does not hold), per
# organisation, key, reason (gateway/metrics.py's REASONS) and UTC minute.
REFUSAL_COLUMNS = ("minute", "org_id", "api_key_id", "reason", "count")
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
    # Narrower exports: usage of one API key or one model name, or one invoice.
    key_id: str | None = None
    model: str | None = None
    invoice_id: str | None = None

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


# The ledger's own columns of the usage export; cost and currency are priced from them.
LEDGER_COLUMNS = USAGE_COLUMNS[: USAGE_COLUMNS.index("cost")]


def _usage_stmt(q: ExportQuery) -> Any:
    """The ledger's rows, each with its deployment's base model and type (which price
    version its tokens are charged at, if any)."""
    stmt = (
        select(*(getattr(UsageEvent, c) for c in LEDGER_COLUMNS), Deployment.model_id, Deployment.type)
        .outerjoin(Deployment, Deployment.id == UsageEvent.deployment_id)
        .where(UsageEvent.created_at >= q.start, UsageEvent.created_at < q.end)
    )
    if q.org_id is not None:
        stmt = stmt.where(UsageEvent.org_id == q.org_id)
    if q.key_id is not None:
        stmt = stmt.where(UsageEvent.api_key_id == q.key_id)
    if q.model is not None:
        stmt = stmt.where(UsageEvent.model == q.model)
    return stmt.order_by(UsageEvent.created_at, UsageEvent.id)


async def _usage_cells(session: AsyncSession) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    prices = await PriceHistory.load(session)
    created, batch_id = LEDGER_COLUMNS.index("created_at"), LEDGER_COLUMNS.index("batch_id")
    tokens = [LEDGER_COLUMNS.index(f"{c}_tokens") for c in ("prompt", "cached", "completion")]

    def cells(row: Sequence[Any]) -> tuple[Any, ...]:
        ledger, (model_id, dep_type) = row[: len(LEDGER_COLUMNS)], row[len(LEDGER_COLUMNS) :]
        price = prices.at(model_id, dep_type, ledger[created])
        prompt, cached, completion = (int(ledger[i] or 0) for i in tokens)
        cost = token_cost(price, prompt, cached, completion, batch=ledger[batch_id] is not None)
        return (
            ledger[0],
            iso(ledger[1]),
            *ledger[2:],
            plain(cost),
            price.currency if price is not None else None,
        )

    return cells


def _static(cells: Callable[[Sequence[Any]], tuple[Any, ...]]) -> CellsFactory:
    """The cells of an export that needs nothing but its row."""

    async def factory(session: AsyncSession) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
        return cells

    return factory


def _refusals_stmt(q: ExportQuery) -> Any:
    stmt = select(*(getattr(Refusal, c) for c in REFUSAL_COLUMNS)).where(
        Refusal.minute >= q.start, Refusal.minute < q.end
    )
    if q.org_id is not None:
        stmt = stmt.where(Refusal.org_id == q.org_id)
    if q.key_id is not None:
        stmt = stmt.where(Refusal.api_key_id == q.key_id)
    return stmt.order_by(Refusal.minute, Refusal.org_id, Refusal.api_key_id, Refusal.reason)


def _refusal_cells(row: Sequence[Any]) -> tuple[Any, ...]:
    return (iso(row[0]), *row[1:4], int(row[4]))


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
        iso(hour),
        org,
        dep or None,
        model,
        adapter or None,
        meter,
        plain(quantity),
        plain(unit_price),
        plain(amount),
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
    if q.invoice_id is not None:
        stmt = stmt.where(Invoice.id == q.invoice_id)
    return stmt.order_by(Invoice.period_start, Invoice.org_id, Invoice.currency, InvoiceLine.position)


def _invoice_cells(row: Sequence[Any]) -> tuple[Any, ...]:
    inv_id, number, org, start, end, status, currency, subtotal, total, finalized = row[:10]
    position, description, meter, model, dep, adapter, quantity, unit_price, amount = row[10:]
    return (
        inv_id,
        invoice_number(number),
        org,
        iso(start),
        iso(end),
        status,
        currency,
        str(cents(subtotal)),
        str(cents(total)),
        iso(finalized),
        position,
        description,
        meter,
        model,
        dep or None,
        adapter or None,
        None if quantity is None else plain(quantity),
        None if unit_price is None else plain(unit_price),
        None if amount is None else str(cents(amount)),
    )


# Per export: its statement, what turns a row into the file's cells (made once per export:
# the usage export loads the price history first), its columns.
EXPORT_SHAPES: dict[str, tuple[Callable[[ExportQuery], Any], CellsFactory, tuple[str, ...]]] = {
    "usage": (_usage_stmt, _usage_cells, USAGE_COLUMNS),
    "refusals": (_refusals_stmt, _static(_refusal_cells), REFUSAL_COLUMNS),
    "rollups": (_rollups_stmt, _static(_rollup_cells), ROLLUP_COLUMNS),
    "invoices": (
        _invoices_stmt,
        _static(_invoice_cells),
        INVOICE_COLUMNS + tuple(f"line_{c}" for c in LINE_COLUMNS),
    ),
}


async def _cells(session: AsyncSession, q: ExportQuery) -> AsyncIterator[tuple[Any, ...]]:
    """The export's rows from a server-side cursor (PostgreSQL) or a stepped SQLite cursor:
    never more than FETCH_ROWS of them in memory."""
    make_stmt, make_cells, _ = EXPORT_SHAPES[q.what]
    to_cells = await make_cells(session)
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


async def export_chunks(
    sessionmaker: async_sessionmaker[AsyncSession], q: ExportQuery
) -> AsyncIterator[bytes]:
    """`stream_export` in a session of its own, open while the body streams: an HTTP
    request's session commits and closes when its handler returns, before the first byte is
    sent."""
    async with sessionmaker() as session:
        async for chunk in stream_export(session, q):
            yield chunk


async def invoice_document(session: AsyncSession, invoice: Invoice, fmt: str) -> bytes:
    """One invoice as a file: in CSV the invoices export's rows of it, in JSON its object
    of that export (indented, since a person downloads it)."""
    q = ExportQuery(
        "invoices",
        fmt,
        as_utc(invoice.period_start),
        as_utc(invoice.period_end),
        org_id=invoice.org_id,
        invoice_id=invoice.id,
    )
    if fmt == "csv":
        return b"".join([chunk async for chunk in stream_export(session, q)])
    found = [obj async for obj in _nest_invoices(_cells(session, q))]
    return msgspec.json.format(msgspec.json.encode(found[0]), indent=2) + b"\n"
