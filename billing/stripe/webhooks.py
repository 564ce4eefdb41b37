"""Stripe's webhooks: a verified event is handled once; payments are recorded, an
organisation whose payment failed is suspended, and that suspension is lifted once its
invoices are paid, through the organisation service (gateways are told by the unit of work,
once committed).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import stripe
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import dialect_insert
from billing.models import StripeInvoicePayment, StripeInvoiceSync, StripeSuspension, StripeWebhookEvent
from control_plane.orgs.models import Organization
from control_plane.policy import SYSTEM
from control_plane.unit import UnitOfWork
from tokenmill.bus import Publisher
from tokenmill.db import utcnow

log = logging.getLogger("tokenmill.billing.stripe")


class WebhookError(ValueError):
    """A webhook request that is not a genuine, recent Stripe event (answered with 400)."""


def verify_webhook(
    payload: bytes, signature: str | None, secret: str, *, tolerance: int = 300
) -> dict[str, Any]:
    """The event of a webhook request whose `Stripe-Signature` is valid: an HMAC-SHA256 of
    `{t}.{payload}` under the endpoint's secret, made no more than `tolerance` seconds ago
    (the SDK's own check) and no more than `tolerance` seconds ahead (the SDK accepts any
    future time, so a signature leaked from a clock-skewed signer would stay valid for as
    long as it was post-dated). Anything else raises WebhookError."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise WebhookError("the payload is not UTF-8") from None
    try:
        stripe.WebhookSignature.verify_header(text, signature, secret, tolerance)
    except stripe.SignatureVerificationError as exc:
        raise WebhookError(str(exc.user_message or exc)) from None
    if _signed_at(signature or "") > time.time() + tolerance:
        raise WebhookError("Timestamp outside the tolerance zone (in the future)")
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):
        raise WebhookError("the payload is not JSON") from None
    if (
        not isinstance(event, dict)
        or not isinstance(event.get("id"), str)
        or not isinstance(event.get("type"), str)
    ):
        raise WebhookError("the payload is not a Stripe event")
    return event


def _signed_at(header: str) -> int:
    """The `t=` of a Stripe-Signature header the SDK verified (so it is there, an integer),
    read as the SDK reads it."""
    items = [item.split("=", 2) for item in header.split(",")]
    return int(next(item[1] for item in items if item[0] == "t"))


@dataclass(slots=True, frozen=True)
class WebhookOutcome:
    event_id: str
    type: str
    outcome: str
    org_id: str | None = None  # whose gateway records changed (suspended or resumed)
    duplicate: bool = False


async def _org_of(session: AsyncSession, obj: dict[str, Any]) -> Organization | None:
    customer = obj.get("customer")
    if isinstance(customer, dict):  # expanded
        customer = customer.get("id")
    if not isinstance(customer, str) or not customer:
        return None
    # Locked: a `paid` and a `payment_failed` of one organisation handled at once must not
    # both read the old status.
    return await session.scalar(
        select(Organization).where(Organization.stripe_customer_id == customer).with_for_update()
    )


async def _upsert_payment(session: AsyncSession, invoice_id: str, org_id: str, **values: Any) -> None:
    stmt = dialect_insert(session)(StripeInvoicePayment).values(
        stripe_invoice_id=invoice_id, org_id=org_id, **values
    )
    await session.execute(stmt.on_conflict_do_update(index_elements=["stripe_invoice_id"], set_=values))


async def _invoice_paid(unit: UnitOfWork, obj: dict[str, Any]) -> tuple[str, str | None]:
    session = unit.session
    invoice_id = obj.get("id")
    org = await _org_of(session, obj)
    if not isinstance(invoice_id, str) or org is None:
        return "ignored: not an invoice of a known customer", None
    now = utcnow()
    await _upsert_payment(session, invoice_id, org.id, status="paid", paid_at=now)
    await session.execute(
        update(StripeInvoiceSync)
        .where(StripeInvoiceSync.stripe_invoice_id == invoice_id, StripeInvoiceSync.paid_at.is_(None))
        .values(paid_at=now)
    )
    unpaid = await session.scalar(
        select(func.count())
        .select_from(StripeInvoicePayment)
        .where(StripeInvoicePayment.org_id == org.id, StripeInvoicePayment.status == "failed")
    )
    suspension = await session.get(StripeSuspension, org.id)
    if suspension is None or unpaid:
        return f"invoice {invoice_id} paid", None
    # Nothing left unpaid: lift the suspension the failed payment caused (not an admin's).
    await session.delete(suspension)
    if not await unit.orgs.resume(org.id, SYSTEM):
        return f"invoice {invoice_id} paid", None
    log.info("organisation %s resumed: Stripe invoice %s paid", org.id, invoice_id)
    return f"invoice {invoice_id} paid; organisation resumed", org.id


async def _payment_failed(unit: UnitOfWork, obj: dict[str, Any]) -> tuple[str, str | None]:
    session = unit.session
    invoice_id = obj.get("id")
    org = await _org_of(session, obj)
    if not isinstance(invoice_id, str) or org is None:
        return "ignored: not an invoice of a known customer", None
    payment = await session.get(StripeInvoicePayment, invoice_id)
    if payment is not None and payment.status == "paid":
        # Stripe does not order deliveries: a failure reported after the payment is stale.
        return f"ignored: invoice {invoice_id} is already paid", None
    await _upsert_payment(session, invoice_id, org.id, status="failed", failed_at=utcnow())
    # Through the organisation service, as an admin's suspension: its keys refused, its
    # deployments scaled to zero, announced to the gateways once committed.
    if not await unit.orgs.suspend(org.id, SYSTEM):
        if await session.get(StripeSuspension, org.id) is None:
            return f"payment of {invoice_id} failed; organisation was already suspended", None
        return f"payment of {invoice_id} failed; organisation stays suspended", None
    reason = f"payment of Stripe invoice {invoice_id} failed"
    session.add(StripeSuspension(org_id=org.id, stripe_invoice_id=invoice_id, reason=reason))
    log.warning("organisation %s suspended: %s", org.id, reason)
    return f"payment of {invoice_id} failed; organisation suspended", org.id


HANDLERS = {"invoice.paid": _invoice_paid, "invoice.payment_failed": _payment_failed}


async def handle_event(
    sessionmaker: async_sessionmaker[AsyncSession],
    event: dict[str, Any],
    *,
    publisher: Publisher | None = None,
) -> WebhookOutcome:
    """Apply a verified event once: its id is recorded in the same transaction as what it
    changes, so a redelivery (or two at once) is a no-op and a failure leaves nothing
    half-done for Stripe's retry. Gateways are told of suspensions after the commit (by the
    unit of work)."""
    event_id, kind = str(event["id"]), str(event["type"])
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    async with UnitOfWork.open(sessionmaker, publisher=publisher) as unit:
        session = unit.session
        inserted = await session.execute(
            dialect_insert(session)(StripeWebhookEvent)
            .values(id=event_id, type=kind[:100], outcome="", received_at=utcnow())
            .on_conflict_do_nothing(index_elements=["id"])
        )
        if not inserted.rowcount:  # type: ignore[attr-defined]
            return WebhookOutcome(event_id, kind, "duplicate: already handled", duplicate=True)
        handler = HANDLERS.get(kind)
        if handler is None or not isinstance(obj, dict):
            outcome, org_id = "ignored", None
        else:
            outcome, org_id = await handler(unit, obj)
        await session.execute(
            update(StripeWebhookEvent).where(StripeWebhookEvent.id == event_id).values(outcome=outcome[:500])
        )
    return WebhookOutcome(event_id, kind, outcome, org_id)
