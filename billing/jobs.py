"""The periodic billing jobs as plain async functions of a sessionmaker, each one
transaction: Celery tasks and the in-process scheduler wrap them (billing/schedule.py).

All of them are idempotent: running one twice, or two at once, leaves what one run leaves.
Order for a month's close: `rollup_hours` over the month's last hours, then
`finalize_invoices` (which rebuilds the drafts from those rollups before freezing them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import month_bounds
from billing.invoices.services import InvoiceBuild, build_invoice_drafts, finalize_invoice
from billing.models import Invoice
from billing.rollups.services import RollupStats, store_rollups
from tokenmill.db import utcnow


async def rollup_hours(
    sessionmaker: async_sessionmaker[AsyncSession], start: datetime, end: datetime
) -> RollupStats:
    """Recompute `usage_rollups` for the whole UTC hours covering [start, end): tokens from
    the ledger, GPU-seconds from the workers' lifetimes, each priced at the price in effect
    then. Rows are upserted, stale ones deleted; a rerun writes nothing."""
    async with sessionmaker() as session, session.begin():
        return await store_rollups(session, start, end)


async def build_invoices(
    sessionmaker: async_sessionmaker[AsyncSession], month: date | datetime | str
) -> InvoiceBuild:
    """Create or refresh every organisation's draft invoice of `month` (a date or time in
    it, or `YYYY-MM`) from the rollups. Finalized invoices are left alone."""
    async with sessionmaker() as session, session.begin():
        return await build_invoice_drafts(session, month)


@dataclass(slots=True)
class FinalizeStats:
    month: str
    build: InvoiceBuild
    finalized: list[str] = field(default_factory=list)  # ids finalized by this run
    already: list[str] = field(default_factory=list)  # ids that were finalized before


async def finalize_invoices(
    sessionmaker: async_sessionmaker[AsyncSession],
    month: date | datetime | str,
    *,
    force: bool = False,
    now: datetime | None = None,
) -> FinalizeStats:
    """Rebuild the drafts of `month` from the rollups, then finalize them (numbered, frozen).
    A month not over yet is refused (ValueError) unless `force`; a second run is a no-op."""
    start, end = month_bounds(month)
    now = now or utcnow()
    if end > now and not force:
        raise ValueError(f"the month {start:%Y-%m} is not over yet (it ends {end.isoformat()})")
    async with sessionmaker() as session, session.begin():
        build = await build_invoice_drafts(session, start)
        stats = FinalizeStats(start.strftime("%Y-%m"), build)
        ids = await session.scalars(
            select(Invoice.id).where(Invoice.period_start == start).order_by(Invoice.org_id, Invoice.currency)
        )
        for invoice_id in list(ids):
            _, changed = await finalize_invoice(session, invoice_id, now=now, force=force)
            (stats.finalized if changed else stats.already).append(invoice_id)
        return stats
