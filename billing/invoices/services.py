"""Monthly invoices, built from the hourly rollups: one per organisation, month and currency.

Drafts are rebuilt whenever invoices are generated (a rerun with unchanged rollups changes
nothing); a finalized invoice is numbered from one gap-free sequence and never changed
again. Each line is the summed quantity of one model x adapter x meter x unit price,
priced and rounded half-even to the cent once (the money rules of DESIGN.md).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload
from sqlalchemy.sql.elements import ColumnElement

from billing.common import PER, as_utc, cents, dialect, dialect_insert, month_bounds, price_text
from billing.models import METERS, Invoice, InvoiceLine, Price, UsageRollup
from control_plane.audit.services import record_change, snapshot
from control_plane.catalog.models import Adapter, Deployment
from control_plane.orgs.models import Organization
from control_plane.paging import Page, PageQuery, contains, keyset_page
from control_plane.policy import Principal, require_platform_admin
from tokenmill.db import new_id, utcnow
from tokenmill.errors import APIError

log = logging.getLogger("tokenmill.billing")

METER_LABELS = {
    "input": "input tokens",
    "cached_input": "cached input tokens",
    "output": "output tokens",
    "batch_input": "batch input tokens",
    "batch_cached_input": "batch cached input tokens",
    "batch_output": "batch output tokens",
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
    """Token lines by model, adapter and meter (online, then batch); GPU time last."""
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
            f"at {price_text(unit_price, currency)} per GPU-hour"
        )
    on = f" with adapter {names.get(adapter, adapter)}" if adapter else ""
    return f"{model}{on}: {METER_LABELS[meter]} at {price_text(unit_price, currency)} per 1M tokens"


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
                dialect_insert(session)(Invoice)
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
    if dialect(session) == "postgresql":
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


async def finalize_invoice_as(
    session: AsyncSession, admin: Principal, invoice_id: str, *, force: bool = False
) -> tuple[Invoice, bool]:
    """`finalize_invoice` by an admin, with its audit entry: only platform admins finalize;
    an organisation admin learns nothing of other tenants' ids (404 unless it is theirs)."""
    if not admin.is_platform_admin:
        await get_invoice(session, invoice_id, org_id=admin.org_id or "")
    require_platform_admin(admin, "finalize invoices")
    before = snapshot(await get_invoice(session, invoice_id))
    invoice, changed = await finalize_invoice(session, invoice_id, force=force)
    if changed:
        await record_change(
            session,
            admin,
            "finalize",
            "invoice",
            invoice.id,
            org_id=invoice.org_id,
            before=before,
            after=invoice,
        )
    return invoice, changed


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


_NUMBER = re.compile(r"^(?:tm-?)?0*(\d{1,9})$", re.IGNORECASE)


def _invoice_search(text: str) -> ColumnElement[bool]:
    """An invoice's id, number (`TM-000012`, `12`) or organisation (id or name) holds `text`."""
    orgs = select(Organization.id).where(contains(Organization.name, text))
    found = [
        contains(Invoice.id, text, lowercase=True),
        contains(Invoice.org_id, text, lowercase=True),
        Invoice.org_id.in_(orgs),
    ]
    if (number := _NUMBER.match(text)) is not None:
        found.append(Invoice.number == int(number.group(1)))
    return or_(*found)


async def list_invoices(
    session: AsyncSession,
    *,
    org_id: str | None = None,
    month: str | None = None,
    status: str | None = None,
    page: PageQuery | None = None,
    offset: int = 0,
) -> Page[Invoice]:
    """Newest period first (then by organisation and currency), without lines; `page` pages
    and searches them (the admin API's old `offset` still skips rows of its first page)."""
    page = page if page is not None else PageQuery(limit=100)
    stmt = select(Invoice)
    if org_id is not None:
        stmt = stmt.where(Invoice.org_id == org_id)
    if month is not None:
        stmt = stmt.where(Invoice.period_start == month_bounds(month)[0])
    if status is not None:
        if status not in ("draft", "finalized"):
            raise APIError(400, "status must be draft or finalized.", param="status")
        stmt = stmt.where(Invoice.status == status)
    if offset:
        if page.paged:
            raise APIError(400, "Page with after/before or with offset, not both.", param="offset")
        stmt = stmt.offset(offset)
    return await keyset_page(
        session,
        stmt,
        page,
        # (organisation, period, currency) is unique, the id only breaks ties for the cursor.
        by=[
            (Invoice.period_start, True),
            (Invoice.org_id, False),
            (Invoice.currency, False),
            (Invoice.id, False),
        ],
        search=_invoice_search,
    )
