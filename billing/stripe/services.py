"""Stripe, in one of two modes per organisation and never both (DESIGN.md's money rules).

- `invoices`: the local invoices are the truth. Each finalized one is mirrored once as a
  Stripe invoice holding one invoice item per line (amounts in the currency's smallest
  unit, exactly the local line amounts), then finalized so Stripe collects it.
- `meters`: usage goes to Stripe as billing meter events, one per organisation, UTC hour,
  model and meter (`<prefix>input_tokens`, `<prefix>cached_input_tokens`,
  `<prefix>output_tokens`, the same three prefixed `batch_` for requests run in a batch,
  `<prefix>gpu_seconds`), read from the hourly rollups; Stripe prices them and writes the
  invoices. Usage that turns up for an hour after it was sent goes as a further event for
  the difference.

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

The parts: billing/stripe/client.py (the client, idempotency keys, amounts),
invoicing.py (customers and `invoices` mode), metering.py (`meters` mode), webhooks.py.
Entry points are plain async functions of a sessionmaker; `stripe_sync_job` is the shape of
a periodic billing job (billing/schedule.py). Secrets are never logged: the API key lives
in a `SecretStr` and only reaches the SDK's Authorization header.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import stripe
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.stripe.client import stripe_client
from billing.stripe.invoicing import ensure_customers, sync_invoices
from billing.stripe.metering import send_meter_events
from tokenmill.settings import Settings

if TYPE_CHECKING:
    from billing.schedule import JobContext


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
