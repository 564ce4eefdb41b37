"""Stripe's `meters` mode: usage sent as billing meter events, Stripe prices it and writes
the invoices.

One event per organisation, UTC hour, model and meter (`<prefix>input_tokens`,
`<prefix>cached_input_tokens`, `<prefix>output_tokens`, `<prefix>gpu_seconds`, and for
requests run in a batch `<prefix>batch_input_tokens`, `<prefix>batch_cached_input_tokens`,
`<prefix>batch_output_tokens`: meters of their own, so Stripe's prices for them carry the
batch discount), read from the hourly rollups. Usage that turns up for an hour after it was
sent goes as a further event for the difference. Each event is recorded `pending`
(`stripe_meter_events`) before it is sent, with a deterministic identifier Stripe
deduplicates, so a crash never changes what an identifier means and a resend counts once.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Collection
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import stripe
from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import TOKEN_METERS, as_utc, dialect_insert, floor_hour, plain
from billing.models import Invoice, StripeInvoiceSync, StripeMeterEvent, UsageRollup
from billing.stripe.client import describe, idem
from control_plane.catalog.models import Deployment
from control_plane.orgs.models import Organization
from tokenmill.db import utcnow

log = logging.getLogger("tokenmill.billing.stripe")

# Meter of the rollups -> suffix of the Stripe meter event name.
METER_EVENTS = {
    "input": "input_tokens",
    "cached_input": "cached_input_tokens",
    "output": "output_tokens",
    "batch_input": "batch_input_tokens",
    "batch_cached_input": "batch_cached_input_tokens",
    "batch_output": "batch_output_tokens",
    "gpu_seconds": "gpu_seconds",
}
# Stripe takes meter events up to 35 days old; stay clear of that edge.
DEFAULT_LOOKBACK = timedelta(days=30)
# A closed hour is sent once this has passed after its end (the hourly rollup job runs a few
# minutes past the hour); anything that turns up later still goes, as a difference.
DEFAULT_SETTLE = timedelta(minutes=15)
SEND_BATCH = 100  # meter events marked sent per commit

MeterKey = tuple[str, datetime, str, str]  # org, hour, model, meter


def meter_identifier(org_id: str, hour: datetime, model: str, meter: str, seq: int) -> str:
    """Deterministic (the same usage always has the same identifier) and under Stripe's 100
    characters: model names can be long, so they enter as a digest."""
    digest = hashlib.sha256(model.encode()).hexdigest()[:12]
    return f"tm-{org_id}-{as_utc(hour):%Y%m%d%H}-{meter}-{digest}-{seq}"


async def _send_meter_event(client: stripe.StripeClient, row: StripeMeterEvent) -> None:
    try:
        await client.v1.billing.meter_events.create_async(
            {
                "event_name": row.event_name,
                "identifier": row.identifier,
                "timestamp": int(as_utc(row.hour).timestamp()),
                "payload": {
                    "stripe_customer_id": row.stripe_customer_id,
                    "value": plain(row.value),
                    "model": row.model,
                },
            },
            idem("meter", row.identifier),
        )
    except stripe.InvalidRequestError as exc:
        # An identifier Stripe already has is what we wanted: it counted the event once.
        text = f"{exc.code or ''} {exc.user_message or ''}".lower()
        if "identifier" in text and ("duplicate" in text or "already" in text):
            return
        raise


async def _usage_totals(
    session: AsyncSession, lo: datetime, hi: datetime
) -> tuple[dict[MeterKey, Decimal], dict[str, str]]:
    """What organisations in `meters` mode used in [lo, hi), per hour, model and meter, from
    the rollups; and their Stripe customers. Tokens of dedicated deployments are left out:
    those are paid by GPU time (the money rules)."""
    customers = dict(
        (
            await session.execute(
                select(Organization.id, Organization.stripe_customer_id).where(
                    Organization.billing_mode == "meters", Organization.stripe_customer_id.is_not(None)
                )
            )
        ).all()
    )
    totals: dict[MeterKey, Decimal] = {}
    if not customers:
        return totals, customers
    charged = or_(
        Deployment.type.is_(None), Deployment.type != "dedicated", UsageRollup.meter.not_in(TOKEN_METERS)
    )
    rows = await session.execute(
        select(
            UsageRollup.org_id,
            UsageRollup.hour,
            UsageRollup.model,
            UsageRollup.meter,
            func.sum(UsageRollup.quantity),
        )
        .outerjoin(Deployment, Deployment.id == UsageRollup.deployment_id)
        .where(
            UsageRollup.org_id.in_(list(customers)),
            UsageRollup.hour >= lo,
            UsageRollup.hour < hi,
            UsageRollup.meter.in_(list(METER_EVENTS)),
            charged,
        )
        .group_by(UsageRollup.org_id, UsageRollup.hour, UsageRollup.model, UsageRollup.meter)
    )
    for org_id, hour, model, meter, quantity in rows:
        totals[org_id, as_utc(hour), model, meter] = Decimal(quantity or 0)
    return totals, customers


async def _mirrored_periods(
    session: AsyncSession, org_ids: Collection[str]
) -> dict[str, list[tuple[datetime, datetime]]]:
    """Periods of invoices mirrored (or being mirrored) to Stripe, per organisation."""
    rows = await session.execute(
        select(Invoice.org_id, Invoice.period_start, Invoice.period_end)
        .join(StripeInvoiceSync, StripeInvoiceSync.invoice_id == Invoice.id)
        .where(Invoice.org_id.in_(list(org_ids)))
    )
    periods: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    for org_id, start, end in rows:
        periods[org_id].append((as_utc(start), as_utc(end)))
    return periods


async def _send_pending(
    sessionmaker: async_sessionmaker[AsyncSession], client: stripe.StripeClient, identifiers: list[str] | None
) -> tuple[int, int]:
    """Send the `pending` meter events (all, or those of `identifiers`) and mark them sent.
    Returns (sent, failed)."""
    async with sessionmaker() as session:
        stmt = select(StripeMeterEvent).where(StripeMeterEvent.status == "pending")
        if identifiers is not None:
            stmt = stmt.where(StripeMeterEvent.identifier.in_(identifiers))
        rows = list(await session.scalars(stmt.order_by(StripeMeterEvent.hour, StripeMeterEvent.identifier)))
    sent: list[str] = []
    failed = 0

    async def mark() -> None:
        if sent:
            async with sessionmaker() as session, session.begin():
                await session.execute(
                    update(StripeMeterEvent)
                    .where(StripeMeterEvent.identifier.in_(sent))
                    .values(status="sent", sent_at=utcnow())
                )
            sent.clear()

    total = 0
    for row in rows:
        try:
            await _send_meter_event(client, row)
        except stripe.StripeError as exc:
            # Stays pending, resent with the same identifier and value next time.
            log.error("could not send meter event %s: %s", row.identifier, describe(exc))
            failed += 1
            continue
        sent.append(row.identifier)
        total += 1
        if len(sent) >= SEND_BATCH:
            await mark()
    await mark()
    return total, failed


async def send_meter_events(
    sessionmaker: async_sessionmaker[AsyncSession],
    client: stripe.StripeClient,
    *,
    event_prefix: str = "tokenmill_",
    now: datetime | None = None,
    settle: timedelta = DEFAULT_SETTLE,
    lookback: timedelta = DEFAULT_LOOKBACK,
) -> int:
    """Send the usage of organisations in `meters` mode as Stripe meter events: every closed
    hour (ended at least `settle` ago, within `lookback`) whose rollups differ from what was
    sent gets an event for the difference. Returns how many events Stripe accepted now.

    Hours inside the period of an invoice mirrored to Stripe are never sent (never both).
    """
    now = as_utc(now or utcnow())
    # Hours starting before `hi` ended at least `settle` ago.
    hi, lo = floor_hour(now - settle), floor_hour(now - lookback)
    # First what an earlier run wrote down but may not have sent (same identifiers, same values).
    resent, _ = await _send_pending(sessionmaker, client, None)
    async with sessionmaker() as session:
        totals, customers = await _usage_totals(session, lo, hi)
        if not customers:
            return resent
        mirrored = await _mirrored_periods(session, customers)
        sent_rows = await session.execute(
            select(
                StripeMeterEvent.org_id,
                StripeMeterEvent.hour,
                StripeMeterEvent.model,
                StripeMeterEvent.meter,
                func.sum(StripeMeterEvent.value),
                func.max(StripeMeterEvent.seq),
            )
            .where(
                StripeMeterEvent.org_id.in_(list(customers)),
                StripeMeterEvent.hour >= lo,
                StripeMeterEvent.hour < hi,
            )
            .group_by(
                StripeMeterEvent.org_id, StripeMeterEvent.hour, StripeMeterEvent.model, StripeMeterEvent.meter
            )
        )
        already: dict[MeterKey, tuple[Decimal, int]] = {
            (org_id, as_utc(hour), model, meter): (Decimal(value or 0), int(seq))
            for org_id, hour, model, meter, value, seq in sent_rows
        }
    new_rows: list[dict[str, Any]] = []
    created = utcnow()
    for key in sorted(set(totals) | set(already)):
        org_id, hour, model, meter = key
        if any(start <= hour < end for start, end in mirrored.get(org_id, ())):
            continue
        sent_value, last_seq = already.get(key, (Decimal(0), -1))
        delta = totals.get(key, Decimal(0)) - sent_value
        if delta == 0:
            continue
        seq = last_seq + 1
        new_rows.append(
            {
                "identifier": meter_identifier(org_id, hour, model, meter, seq),
                "org_id": org_id,
                "hour": hour,
                "model": model,
                "meter": meter,
                "seq": seq,
                "event_name": event_prefix + METER_EVENTS[meter],
                "stripe_customer_id": customers[org_id],
                "value": delta,
                "status": "pending",
                "created_at": created,
            }
        )
    if not new_rows:
        return resent
    # Written down first: from here on these identifiers mean exactly these values.
    async with sessionmaker() as session, session.begin():
        insert = dialect_insert(session)
        for i in range(0, len(new_rows), 500):
            chunk = new_rows[i : i + 500]
            await session.execute(insert(StripeMeterEvent).values(chunk).on_conflict_do_nothing())
    sent, _ = await _send_pending(sessionmaker, client, [r["identifier"] for r in new_rows])
    return resent + sent
