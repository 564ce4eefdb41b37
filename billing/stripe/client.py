"""The Stripe client and what every Stripe call of billing needs: idempotency keys,
error descriptions without secrets, and amounts in the currency's smallest unit.

Secrets are never logged: the API key lives in a `SecretStr` and only reaches the SDK's
Authorization header.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import stripe

from tokenmill.settings import Settings

# Stripe amounts are integers in the currency's smallest unit: most currencies have cents,
# these have none, and these count thousandths.
ZERO_DECIMAL = frozenset(
    "bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split()  # noqa: SIM905
)
THREE_DECIMAL = frozenset("bhd jod kwd omr tnd".split())  # noqa: SIM905


class StripeNotConfigured(RuntimeError):
    """No Stripe API key in the settings."""


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


def idem(*parts: str) -> dict[str, Any]:
    """Request options with an Idempotency-Key derived from our own ids, so a retry or a
    rerun of the same step is the same request to Stripe."""
    return {"idempotency_key": "tokenmill-" + "-".join(parts)}


def describe(exc: stripe.StripeError) -> str:
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
