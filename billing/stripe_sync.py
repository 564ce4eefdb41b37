"""Stripe, in one of two modes per organisation and never both (DESIGN.md's money rules).

- `invoices`: the local invoices are the truth. Each finalized one is mirrored once as a
  Stripe invoice holding one invoice item per line (amounts in the currency's smallest
  unit, exactly the local line amounts), then finalized so Stripe collects it.
- `meters`: usage goes to Stripe as billing meter events, one per organisation, UTC hour,
  model and meter (`<prefix>input_tokens`, `<prefix>cached_input_tokens`,
  `<prefix>output_tokens`, `<prefix>gpu_seconds`), read from the hourly rollups; Stripe
  prices them and writes the invoices. Usage that turns up for an hour after it was sent
  goes as a further event for the difference.

Every organisation with a billing mode gets one Stripe customer (metadata `org_id`).

Rerunning any of this changes nothing, at two levels. Locally, what was sent is recorded
(`stripe_invoice_syncs`, `stripe_meter_events`) and skipped next time; each record is
written *before* the Stripe call it stands for, so a run that died between Stripe's answer
and our commit knows that something may exist and looks (invoices) or resends the very
same identifier and value (meter events). At Stripe, every POST carries an
`Idempotency-Key` derived from our ids, and every meter event a deterministic
`identifier`, both deduplicated by Stripe for at least 24 hours.

The webhook side (`verify_webhook`, `handle_event`) checks Stripe's signature, handles each
event id once, records payments, suspends an organisation whose payment failed and lifts
that suspension once its invoices are paid, telling the gateways at once (`KeysChanged`).

Entry points are plain async functions of a sessionmaker; `stripe_sync_job` is the shape
of a periodic billing job (billing/schedule.py). Secrets are never logged: the API key
lives in a `SecretStr` and only reaches the SDK's Authorization header.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import stripe
from sqlalchemy import func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from billing.models import (
    Invoice,
    StripeInvoicePayment,
    StripeInvoiceSync,
    StripeMeterEvent,
    StripeSuspension,
    StripeWebhookEvent,
    UsageRollup,
)
from billing.services import as_utc, floor_hour, invoice_number
from control_plane.models import Deployment, Organization
from tokenmill.bus import Publisher
from tokenmill.db import utcnow
from tokenmill.protocol import KEYS, KeysChanged
from tokenmill.settings import Settings

if TYPE_CHECKING:
    from billing.schedule import JobContext

log = logging.getLogger("tokenmill.billing.stripe")

MODES = ("invoices", "meters")
HOUR = timedelta(hours=1)
# Meter of the rollups -> suffix of the Stripe meter event name.
METER_EVENTS = {
    "input": "input_tokens",
    "cached_input": "cached_input_tokens",
    "output": "output_tokens",
    "gpu_seconds": "gpu_seconds",
}
TOKEN_METERS = ("input", "cached_input", "output")
# Stripe amounts are integers in the currency's smallest unit: most currencies have cents,
# these have none, and these count thousandths.
ZERO_DECIMAL = frozenset(
    "bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split()  # noqa: SIM905
)
THREE_DECIMAL = frozenset("bhd jod kwd omr tnd".split())  # noqa: SIM905
# Stripe takes meter events up to 35 days old; stay clear of that edge.
DEFAULT_LOOKBACK = timedelta(days=30)
# A closed hour is sent once this has passed after its end (the hourly rollup job runs a few
# minutes past the hour); anything that turns up later still goes, as a difference.
DEFAULT_SETTLE = timedelta(minutes=15)
SEND_BATCH = 100  # meter events marked sent per commit


class StripeNotConfigured(RuntimeError):
    """No Stripe API key in the settings."""


class WebhookError(ValueError):
    """A webhook request that is not a genuine, recent Stripe event (answered with 400)."""


# --- the client -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stripe_client(
    settings: Settings, *, max_network_retries: int = 2
) -> AsyncIterator[stripe.StripeClient]:
    """A StripeClient on its own async HTTP client, closed afterwards. Network errors and
    5xx answers are retried by the SDK with the same Idempotency-Key."""
    if settings.stripe_api_key is None:
        raise StripeNotConfigured("TOKENMILL_STRIPE_API_KEY is not set")
    http = stripe.HTTPXClient(timeout=30)
    base = settings.stripe_api_base.rstrip("/") if settings.stripe_api_base else None
    client = stripe.StripeClient(
        settings.stripe_api_key.get_secret_value(),
        base_addresses={"api": base, "meter_events": base} if base else None,
        http_client=http,
        max_network_retries=max_network_retries,
    )
    try:
        yield client
    finally:
        await http.close_async()


def _idem(*parts: str) -> dict[str, Any]:
    """Request options with an Idempotency-Key derived from our own ids, so a retry or a
    rerun of the same step is the same request to Stripe."""
    return {"idempotency_key": "tokenmill-" + "-".join(parts)}


def _describe(exc: stripe.StripeError) -> str:
    # The SDK's message plus Stripe's request id: enough to look the call up, no secrets.
    return f"{type(exc).__name__} {exc.http_status or ''} {exc.request_id or ''}: {exc.user_message or exc}"


def minor_units(amount: Decimal, currency: str) -> int:
    """An amount as Stripe's integer in the currency's smallest unit; refuses to round."""
    currency = currency.lower()
    exponent = 0 if currency in ZERO_DECIMAL else 3 if currency in THREE_DECIMAL else 2
    scaled = amount.scaleb(exponent)
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{amount} {currency} is not a whole number of the currency's smallest unit")
    return int(scaled)


def _number(d: Decimal) -> str:
    """A quantity as Stripe reads numbers: plain digits, no exponent, no trailing zeros."""
    text = format(d.normalize(), "f")
    return "0" if text in ("-0", "") else text


def _insert(session: AsyncSession) -> Any:
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


# --- customers --------------------------------------------------------------------------


async def _find_customer(client: stripe.StripeClient, org_id: str) -> str | None:
    """A customer an earlier run created for `org_id` but could not record (it died between
    Stripe's answer and our commit, longer ago than Stripe keeps idempotency keys)."""
    escaped = org_id.replace("\\", "\\\\").replace("'", "\\'")
    try:
        found = await client.v1.customers.search_async({"query": f"metadata['org_id']:'{escaped}'"})
    except stripe.InvalidRequestError as exc:  # search is not offered everywhere
        log.debug("customer search unavailable (%s); relying on the idempotency key", _describe(exc))
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
                    {"name": name, "metadata": {"org_id": org_id}}, _idem("customer", org_id)
                )
                customer_id = customer.id
        except stripe.StripeError as exc:
            log.error("could not create the Stripe customer of %s: %s", org_id, _describe(exc))
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
                _insert(session)(StripeInvoiceSync)
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
                _idem("invoice", invoice_id),
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
                        "quantity": _number(line.quantity),
                    },
                },
                _idem("invoice", invoice_id, "line", str(line.id)),
            )
        remote = await client.v1.invoices.finalize_invoice_async(
            stripe_id, {"auto_advance": True}, _idem("invoice", invoice_id, "finalize")
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
            log.error("could not mirror invoice %s to Stripe: %s", invoice_id, _describe(exc))
        except ValueError as exc:
            log.error("cannot mirror invoice %s to Stripe: %s", invoice_id, exc)
    return done


# --- meters mode ------------------------------------------------------------------------

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
                    "value": _number(row.value),
                    "model": row.model,
                },
            },
            _idem("meter", row.identifier),
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
            log.error("could not send meter event %s: %s", row.identifier, _describe(exc))
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
        for i in range(0, len(new_rows), 500):
            await session.execute(
                _insert(session)(StripeMeterEvent).values(new_rows[i : i + 500]).on_conflict_do_nothing()
            )
    sent, _ = await _send_pending(sessionmaker, client, [r["identifier"] for r in new_rows])
    return resent + sent


# --- one run ----------------------------------------------------------------------------


@dataclass(slots=True)
class StripeSyncStats:
    configured: bool = True
    customers: int = 0  # organisations that got a Stripe customer
    invoices: int = 0  # local invoices mirrored and finalized in Stripe
    meter_events: int = 0  # meter events Stripe accepted


async def sync_stripe(
    sessionmaker: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    now: datetime | None = None,
    client: stripe.StripeClient | None = None,
) -> StripeSyncStats:
    """Customers, then invoices mode, then meters mode. Without an API key: nothing."""
    if client is None:
        if settings.stripe_api_key is None:
            return StripeSyncStats(configured=False)
        async with stripe_client(settings) as own:
            return await sync_stripe(sessionmaker, settings, now=now, client=own)
    stats = StripeSyncStats()
    stats.customers = await ensure_customers(sessionmaker, client)
    stats.invoices = await sync_invoices(sessionmaker, client)
    stats.meter_events = await send_meter_events(
        sessionmaker, client, event_prefix=settings.stripe_meter_prefix, now=now
    )
    return stats


async def stripe_sync_job(ctx: JobContext, now: datetime, **_: Any) -> StripeSyncStats:
    """The periodic job (billing/schedule.py): one `sync_stripe` run."""
    return await sync_stripe(ctx.sessionmaker, ctx.settings, now=now)


# --- webhooks ---------------------------------------------------------------------------


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
    stmt = _insert(session)(StripeInvoicePayment).values(
        stripe_invoice_id=invoice_id, org_id=org_id, **values
    )
    await session.execute(stmt.on_conflict_do_update(index_elements=["stripe_invoice_id"], set_=values))


async def _invoice_paid(session: AsyncSession, obj: dict[str, Any]) -> tuple[str, str | None]:
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
    if org.status != "suspended":
        return f"invoice {invoice_id} paid", None
    org.status = "active"
    log.info("organisation %s resumed: Stripe invoice %s paid", org.id, invoice_id)
    return f"invoice {invoice_id} paid; organisation resumed", org.id


async def _payment_failed(session: AsyncSession, obj: dict[str, Any]) -> tuple[str, str | None]:
    invoice_id = obj.get("id")
    org = await _org_of(session, obj)
    if not isinstance(invoice_id, str) or org is None:
        return "ignored: not an invoice of a known customer", None
    payment = await session.get(StripeInvoicePayment, invoice_id)
    if payment is not None and payment.status == "paid":
        # Stripe does not order deliveries: a failure reported after the payment is stale.
        return f"ignored: invoice {invoice_id} is already paid", None
    await _upsert_payment(session, invoice_id, org.id, status="failed", failed_at=utcnow())
    if org.status != "active":
        if await session.get(StripeSuspension, org.id) is None:
            return f"payment of {invoice_id} failed; organisation was already suspended", None
        return f"payment of {invoice_id} failed; organisation stays suspended", None
    org.status = "suspended"
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
    half-done for Stripe's retry. Gateways are told of suspensions after the commit."""
    event_id, kind = str(event["id"]), str(event["type"])
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    async with sessionmaker() as session, session.begin():
        inserted = await session.execute(
            _insert(session)(StripeWebhookEvent)
            .values(id=event_id, type=kind[:100], outcome="", received_at=utcnow())
            .on_conflict_do_nothing(index_elements=["id"])
        )
        if not inserted.rowcount:  # type: ignore[attr-defined]
            return WebhookOutcome(event_id, kind, "duplicate: already handled", duplicate=True)
        handler = HANDLERS.get(kind)
        if handler is None or not isinstance(obj, dict):
            outcome, org_id = "ignored", None
        else:
            outcome, org_id = await handler(session, obj)
        await session.execute(
            update(StripeWebhookEvent).where(StripeWebhookEvent.id == event_id).values(outcome=outcome[:500])
        )
    if org_id is not None and publisher is not None:
        try:
            await publisher.publish(KEYS, KeysChanged(org_id=org_id))
        except Exception:
            # Gateways re-read key records within their TTL (30 s) anyway.
            log.exception("could not tell the gateways that organisation %s changed", org_id)
    return WebhookOutcome(event_id, kind, outcome, org_id)
