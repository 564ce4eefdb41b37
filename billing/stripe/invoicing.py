"""Stripe's `invoices` mode, and the customers of both modes.

The local invoices are the truth: each finalized one is mirrored once as a Stripe invoice
holding one invoice item per line (amounts in the currency's smallest unit, exactly the
local line amounts), then finalized so Stripe collects it. A `stripe_invoice_syncs` row is
written before the first Stripe call for an invoice, so a run that died between Stripe's
answer and our commit looks for what it may have created instead of creating it again.
Every organisation with a billing mode gets one Stripe customer (metadata `org_id`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import datetime
from typing import Any

import stripe
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from billing.common import as_utc, dialect_insert, plain
from billing.invoices.services import invoice_number
from billing.models import Invoice, StripeInvoiceSync, StripeMeterEvent
from billing.stripe.client import describe, idem, minor_units
from control_plane.orgs.models import Organization
from tokenmill.db import utcnow

log = logging.getLogger("tokenmill.billing.stripe")

MODES = ("invoices", "meters")


# --- customers --------------------------------------------------------------------------


async def _find_customer(client: stripe.StripeClient, org_id: str) -> str | None:
    """A customer an earlier run created for `org_id` but could not record (it died between
    Stripe's answer and our commit, longer ago than Stripe keeps idempotency keys)."""
    escaped = org_id.replace("\\", "\\\\").replace("'", "\\'")
    try:
        found = await client.v1.customers.search_async({"query": f"metadata['org_id']:'{escaped}'"})
    except stripe.InvalidRequestError as exc:  # search is not offered everywhere
        log.debug("customer search unavailable (%s); relying on the idempotency key", describe(exc))
        return None
    ids = sorted(c.id for c in found.data)
    return ids[0] if ids else None


async def ensure_customers(
    sessionmaker: async_sessionmaker[AsyncSession],
    client: stripe.StripeClient,
    *,
    org_ids: Collection[str] | None = None,
) -> int:
    """Give every organisation with a billing mode (or those of `org_ids`) its Stripe
    customer, once: returns how many got one now. Organisations with one are not touched."""
    async with sessionmaker() as session:
        stmt = select(Organization.id, Organization.name).where(
            Organization.billing_mode.in_(MODES), Organization.stripe_customer_id.is_(None)
        )
        if org_ids is not None:
            stmt = stmt.where(Organization.id.in_(list(org_ids)))
        orgs = (await session.execute(stmt.order_by(Organization.id))).all()
    done = 0
    for org_id, name in orgs:
        try:
            customer_id = await _find_customer(client, org_id)
            if customer_id is None:
                customer = await client.v1.customers.create_async(
                    {"name": name, "metadata": {"org_id": org_id}}, idem("customer", org_id)
                )
                customer_id = customer.id
        except stripe.StripeError as exc:
            log.error("could not create the Stripe customer of %s: %s", org_id, describe(exc))
            continue
        async with sessionmaker() as session, session.begin():
            # Only if still unset: a concurrent run got the same customer (same key) meanwhile.
            await session.execute(
                update(Organization)
                .where(Organization.id == org_id, Organization.stripe_customer_id.is_(None))
                .values(stripe_customer_id=customer_id)
            )
        log.info("organisation %s is Stripe customer %s", org_id, customer_id)
        done += 1
    return done


# --- invoices mode ----------------------------------------------------------------------


async def _metered_between(session: AsyncSession, org_id: str, start: datetime, end: datetime) -> bool:
    """Whether any usage of [start, end) went to Stripe as meter events."""
    found = await session.scalar(
        select(StripeMeterEvent.identifier)
        .where(StripeMeterEvent.org_id == org_id, StripeMeterEvent.hour >= start, StripeMeterEvent.hour < end)
        .limit(1)
    )
    return found is not None


def _metadata(obj: Any, key: str) -> str | None:
    """One metadata value of a Stripe object (StripeObject is not a dict: no `.get`)."""
    metadata = getattr(obj, "metadata", None)
    try:
        return None if metadata is None else str(metadata[key])
    except KeyError:
        return None


async def _find_stripe_invoice(client: stripe.StripeClient, customer_id: str, invoice_id: str) -> Any | None:
    """The Stripe invoice an earlier, interrupted run created for our `invoice_id`."""
    page = await client.v1.invoices.list_async({"customer": customer_id, "limit": 100})
    async for inv in page.auto_paging_iter():
        if _metadata(inv, "tokenmill_invoice_id") == invoice_id:
            return inv
    return None


async def _line_ids_on(client: stripe.StripeClient, stripe_invoice_id: str) -> set[str]:
    """Our line ids already added to a Stripe invoice (by an interrupted run)."""
    page = await client.v1.invoice_items.list_async({"invoice": stripe_invoice_id, "limit": 100})
    found = {_metadata(item, "tokenmill_line_id") async for item in page.auto_paging_iter()}
    return {line_id for line_id in found if line_id}


async def mirror_invoice(
    sessionmaker: async_sessionmaker[AsyncSession], client: stripe.StripeClient, invoice_id: str
) -> bool:
    """Mirror one finalized local invoice to Stripe (invoice, items, finalization), resuming
    wherever an earlier run stopped. True when it is (now) mirrored and finalized."""
    async with sessionmaker() as session:
        inv = await session.scalar(
            select(Invoice).options(selectinload(Invoice.lines)).where(Invoice.id == invoice_id)
        )
        if inv is None or inv.status != "finalized":
            return False
        org = await session.get(Organization, inv.org_id)
        sync = await session.get(StripeInvoiceSync, invoice_id)
        metered = await _metered_between(
            session, inv.org_id, as_utc(inv.period_start), as_utc(inv.period_end)
        )
    if sync is not None and sync.status == "finalized":
        return True
    if org is None or org.billing_mode != "invoices" or org.stripe_customer_id is None:
        return False
    if metered:
        # Never both: this usage was already sent as meter events (the organisation changed
        # mode during the period). Mirroring the invoice would bill it twice.
        log.error(
            "not mirroring invoice %s to Stripe: organisation %s sent meter events for %s; "
            "settle the period by hand",
            invoice_id,
            org.id,
            f"{as_utc(inv.period_start):%Y-%m}",
        )
        return False
    currency = inv.currency.lower()
    # Converted before any Stripe call: an amount Stripe cannot take stops the invoice here.
    lines = [(line, minor_units(line.amount, currency)) for line in inv.lines]
    total = minor_units(inv.total, currency)
    customer_id = org.stripe_customer_id

    # A sync row written before the first call: its presence means a Stripe invoice may exist.
    may_exist = sync is not None
    if sync is None:
        async with sessionmaker() as session, session.begin():
            await session.execute(
                dialect_insert(session)(StripeInvoiceSync)
                .values(invoice_id=invoice_id, org_id=org.id, status="pending", created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["invoice_id"])
            )
    stripe_id = sync.stripe_invoice_id if sync is not None else None
    period = f"{as_utc(inv.period_start):%Y-%m}"
    number = invoice_number(inv.number) or invoice_id
    if stripe_id is not None:
        remote = await client.v1.invoices.retrieve_async(stripe_id)
    else:
        remote = await _find_stripe_invoice(client, customer_id, invoice_id) if may_exist else None
        if remote is None:
            remote = await client.v1.invoices.create_async(
                {
                    "customer": customer_id,
                    "currency": currency,
                    # Finalized by us once every item is on it, not by Stripe an hour later.
                    "auto_advance": False,
                    # Only this invoice's items, never other pending items of the customer.
                    "pending_invoice_items_behavior": "exclude",
                    "description": f"Tokenmill usage {period}, invoice {number}",
                    "metadata": {"tokenmill_invoice_id": invoice_id, "org_id": org.id, "number": number},
                },
                idem("invoice", invoice_id),
            )
        stripe_id = remote.id
        async with sessionmaker() as session, session.begin():
            await session.execute(
                update(StripeInvoiceSync)
                .where(StripeInvoiceSync.invoice_id == invoice_id)
                .values(stripe_invoice_id=stripe_id, status="created")
            )

    if remote.status == "draft":
        # Items an interrupted run added are already there; a new invoice has none.
        present = await _line_ids_on(client, stripe_id) if may_exist else set()
        start, end = int(as_utc(inv.period_start).timestamp()), int(as_utc(inv.period_end).timestamp())
        for line, amount in lines:
            if str(line.id) in present:
                continue
            await client.v1.invoice_items.create_async(
                {
                    "customer": customer_id,
                    "invoice": stripe_id,
                    "currency": currency,
                    "amount": amount,
                    "description": line.description[:500],
                    "period": {"start": start, "end": end},
                    "metadata": {
                        "tokenmill_invoice_id": invoice_id,
                        "tokenmill_line_id": str(line.id),
                        "meter": line.meter,
                        "quantity": plain(line.quantity),
                    },
                },
                idem("invoice", invoice_id, "line", str(line.id)),
            )
        remote = await client.v1.invoices.finalize_invoice_async(
            stripe_id, {"auto_advance": True}, idem("invoice", invoice_id, "finalize")
        )
    if remote.total != total:
        # Stripe's copy disagrees with ours (e.g. tax or a discount configured in Stripe).
        log.error(
            "Stripe invoice %s totals %s, local invoice %s %s", stripe_id, remote.total, invoice_id, total
        )
    async with sessionmaker() as session, session.begin():
        await session.execute(
            update(StripeInvoiceSync)
            .where(StripeInvoiceSync.invoice_id == invoice_id)
            .values(status="finalized", stripe_total=remote.total, finalized_at=utcnow())
        )
    log.info("invoice %s mirrored as Stripe invoice %s", invoice_id, stripe_id)
    return True


async def sync_invoices(sessionmaker: async_sessionmaker[AsyncSession], client: stripe.StripeClient) -> int:
    """Mirror every finalized local invoice of organisations in `invoices` mode that is not
    mirrored yet; returns how many were completed now. One invoice's failure (logged) does
    not stop the others; it is retried on the next run."""
    async with sessionmaker() as session:
        ids = list(
            await session.scalars(
                select(Invoice.id)
                .join(Organization, Organization.id == Invoice.org_id)
                .outerjoin(StripeInvoiceSync, StripeInvoiceSync.invoice_id == Invoice.id)
                .where(
                    Invoice.status == "finalized",
                    Organization.billing_mode == "invoices",
                    Organization.stripe_customer_id.is_not(None),
                    (StripeInvoiceSync.status.is_(None)) | (StripeInvoiceSync.status != "finalized"),
                )
                .order_by(Invoice.period_start, Invoice.id)
            )
        )
    done = 0
    for invoice_id in ids:
        try:
            done += await mirror_invoice(sessionmaker, client, invoice_id)
        except stripe.StripeError as exc:
            log.error("could not mirror invoice %s to Stripe: %s", invoice_id, describe(exc))
        except ValueError as exc:
            log.error("cannot mirror invoice %s to Stripe: %s", invoice_id, exc)
    return done
