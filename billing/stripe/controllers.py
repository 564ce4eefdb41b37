"""Stripe's webhook endpoint (HTTP only: what an event does is billing/stripe/webhooks.py's)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from tokenmill.errors import APIError


class StripeWebhookController(Controller):
    """`POST /webhooks/stripe`: events Stripe signs with the endpoint's secret. Outside
    /admin and without an API key, since the signature is the authentication; left out of
    the OpenAPI document, which describes the API our users call."""

    path = "/webhooks/stripe"
    include_in_schema = False

    @post("/", status_code=200)
    async def receive(self, request: Request) -> dict[str, Any]:
        # Imported here: the Stripe SDK loads only in processes that receive webhooks.
        from billing.stripe.webhooks import WebhookError, handle_event, verify_webhook

        secret = request.app.state.settings.stripe_webhook_secret
        if secret is None:
            # Not a 4xx: Stripe retries for days, so events wait until the secret is set.
            raise APIError(
                503,
                "Stripe webhooks are not configured: set TOKENMILL_STRIPE_WEBHOOK_SECRET.",
                code="stripe_webhooks_not_configured",
            )
        try:
            event = verify_webhook(
                await request.body(), request.headers.get("stripe-signature"), secret.get_secret_value()
            )
        except WebhookError as exc:
            raise APIError(400, f"Invalid Stripe webhook: {exc}", code="invalid_signature") from None
        result = await handle_event(request.app.state.sessionmaker, event, publisher=request.app.state.bus)
        return {"id": result.event_id, "type": result.type, "outcome": result.outcome}
