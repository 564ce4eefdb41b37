"""`POST /webhooks/stripe` on a real app (uvicorn, the app of `create_app`): signatures checked
exactly as Stripe signs (HMAC-SHA256 of `{t}.{payload}`, 5 minutes of tolerance), each event
handled once, a failed payment suspending the organisation on every gateway at once and
the payment lifting it. SQLite and PostgreSQL; the last test goes through the gateway."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from litestar import Litestar
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import Invoice, StripeInvoiceSync, StripeSuspension, StripeWebhookEvent
from control_plane.orgs.models import Organization
from tests import databases
from tests.billing.billing_world import serve
from tests.billing.fake_stripe import FakeStripe
from tests.gateway.conftest import Env, gateway_env  # noqa: F401  (the fixture)
from tokenmill.app import Parts, create_app
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.protocol import KEYS, KeysChanged
from tokenmill.settings import Settings

SECRET = "whsec_test_tokenmill"
CUSTOMER = "cus_test_acme"


@dataclass
class Hook:
    client: httpx.AsyncClient
    app: Litestar
    sm: async_sessionmaker[AsyncSession]
    org_id: str

    async def send(
        self,
        event: dict[str, Any],
        *,
        secret: str = SECRET,
        timestamp: int | None = None,
        body: bytes | None = None,
    ) -> httpx.Response:
        """POST `event` (or a raw `body`), signed as Stripe signs it with `secret` at `timestamp`."""
        payload = json.dumps(event).encode() if body is None else body
        signature = FakeStripe.sign(payload, secret, timestamp)
        return await self.client.post(
            "/webhooks/stripe",
            content=payload,
            headers={"stripe-signature": signature, "content-type": "application/json"},
        )

    async def org(self, org_id: str | None = None) -> Organization:
        async with self.sm() as s:
            org = await s.get(Organization, org_id or self.org_id)
            assert org is not None
            return org

    async def key_events(self) -> list[KeysChanged]:
        entries = await self.app.state.bus.read(KEYS, "0", block=0)
        return [msgspec.json.decode(raw, type=KeysChanged) for _, raw in entries]


def event(
    kind: str, invoice_id: str, customer: str = CUSTOMER, event_id: str | None = None
) -> dict[str, Any]:
    """A Stripe event as Stripe sends it: the invoice snapshot under data.object."""
    return {
        "id": event_id or f"evt_{kind.replace('.', '_')}_{invoice_id}",
        "object": "event",
        "api_version": "2025-01-27.acacia",
        "created": int(time.time()),
        "livemode": False,
        "type": kind,
        "data": {"object": {"id": invoice_id, "object": "invoice", "customer": customer, "status": "open"}},
    }


@pytest.fixture
async def hook(db_url: str, tmp_path: Path) -> AsyncIterator[Hook]:
    await asyncio.to_thread(databases.migrate, db_url)
    settings = Settings(
        home=tmp_path,
        database_url=db_url,
        secret_key="test-secret",
        internal_token="internal",
        stripe_webhook_secret=SecretStr(SECRET),
    )
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    async with sm() as s, s.begin():
        org = Organization(name="acme", billing_mode="invoices", stripe_customer_id=CUSTOMER)
        s.add(org)
        await s.flush()
        org_id = org.id
    app = create_app(settings, engine, Parts(admin=True))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield Hook(client, app, sm, org_id)


# --- signatures -------------------------------------------------------------------------


async def test_only_genuine_recent_events_are_accepted(hook: Hook) -> None:
    ev = event("customer.updated", "in_1")
    body = json.dumps(ev).encode()
    now = int(time.time())
    refused = {
        "wrong secret": await hook.send(ev, secret="whsec_someone_else"),
        "too old": await hook.send(ev, timestamp=now - 301),
        "tampered": await hook.client.post(
            "/webhooks/stripe",
            content=body.replace(b"customer.updated", b"invoice.paid"),
            headers={"stripe-signature": FakeStripe.sign(body, SECRET)},
        ),
        "no header": await hook.client.post("/webhooks/stripe", content=body),
        "garbage header": await hook.client.post(
            "/webhooks/stripe", content=body, headers={"stripe-signature": "t=abc,v1=zz"}
        ),
        "not utf-8": await hook.send(ev, body=b"\xff\xfe{}"),
        "not json": await hook.send(ev, body=b"{nope"),
        "not an event": await hook.send(ev, body=b'{"object": "event"}'),
    }
    for why, r in refused.items():
        assert r.status_code == 400, (why, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_signature", why
    async with hook.sm() as s:
        assert (await s.scalars(select(StripeWebhookEvent))).all() == []

    # Within the tolerance, and with several signatures (Stripe sends one per secret while an
    # endpoint's secret is being rolled), the event is accepted.
    ok = await hook.send(ev, timestamp=now - 290)
    assert ok.status_code == 200 and ok.json() == {
        "id": ev["id"],
        "type": "customer.updated",
        "outcome": "ignored",
    }
    ev2 = event("customer.updated", "in_2")
    body2 = json.dumps(ev2).encode()
    good = FakeStripe.sign(body2, SECRET)
    stale = FakeStripe.sign(body2, "whsec_old").split(",")[1]
    r = await hook.client.post(
        "/webhooks/stripe", content=body2, headers={"stripe-signature": f"{good},{stale}"}
    )
    assert r.status_code == 200


async def test_signatures_dated_in_the_future_are_refused(hook: Hook) -> None:
    """The SDK checks only that a signature is not too old: one post-dated an hour (a signer's
    clock far ahead, or a replay prepared in advance) would stay valid for that hour."""
    ev = event("customer.updated", "in_future")
    now = int(time.time())
    # a minute past the tolerance, not one second: a slow machine's first request can take
    # longer than the margin between the test's clock reading and the server's
    for ahead in (3600, 360):
        r = await hook.send(ev, timestamp=now + ahead)
        assert r.status_code == 400, (ahead, r.text)
        assert r.json()["error"] == {
            "message": "Invalid Stripe webhook: Timestamp outside the tolerance zone (in the future)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_signature",
        }
    async with hook.sm() as s:
        assert (await s.scalars(select(StripeWebhookEvent))).all() == []
    # A clock a little ahead of ours is within the tolerance, as Stripe's is.
    assert (await hook.send(ev, timestamp=now + 60)).status_code == 200


async def test_undecodable_signed_bodies_are_400s(hook: Hook) -> None:
    """Correctly signed, so they reach the JSON decoding: never a 500."""
    ev = event("customer.updated", "in_1")
    bodies = {
        "invalid UTF-8 in a string": b'{"id": "evt_1", "type": "x\xff"}',
        "10,000 levels deep": b'{"id": "evt_1", "type": "x", "data": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        "truncated": json.dumps(ev).encode()[:-7],
    }
    for why, body in bodies.items():
        r = await hook.send(ev, body=body)
        assert r.status_code == 400, (why, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_signature", why


async def test_unconfigured_webhooks_answer_503(hook: Hook) -> None:
    hook.app.state.settings.stripe_webhook_secret = None
    r = await hook.send(event("invoice.paid", "in_1"))
    assert r.status_code == 503 and "TOKENMILL_STRIPE_WEBHOOK_SECRET" in r.json()["error"]["message"]


# --- reactions --------------------------------------------------------------------------


async def test_failed_payment_suspends_until_paid(hook: Hook) -> None:
    # A mirrored invoice, so `invoice.paid` marks the local invoice paid too.
    async with hook.sm() as s, s.begin():
        inv = Invoice(
            org_id=hook.org_id,
            period_start=datetime(2025, 1, 1, tzinfo=UTC),
            period_end=datetime(2025, 2, 1, tzinfo=UTC),
            currency="usd",
            status="finalized",
            number=1,
            subtotal=Decimal("12.34"),
            total=Decimal("12.34"),
        )
        s.add(inv)
        await s.flush()
        s.add(
            StripeInvoiceSync(
                invoice_id=inv.id, org_id=hook.org_id, stripe_invoice_id="in_1", status="finalized"
            )
        )

    failed = event("invoice.payment_failed", "in_1")
    r = await hook.send(failed)
    assert r.status_code == 200 and r.json()["outcome"] == "payment of in_1 failed; organisation suspended"
    assert (await hook.org()).status == "suspended"
    async with hook.sm() as s:
        suspension = await s.get(StripeSuspension, hook.org_id)
        assert suspension is not None and "in_1" in suspension.reason
    assert await hook.key_events() == [KeysChanged(org_id=hook.org_id)]

    # Stripe delivers at least once: the same event again changes nothing.
    again = await hook.send(failed)
    assert again.status_code == 200 and again.json()["outcome"] == "duplicate: already handled"
    assert await hook.key_events() == [KeysChanged(org_id=hook.org_id)]

    paid = await hook.send(event("invoice.paid", "in_1"))
    assert paid.status_code == 200 and paid.json()["outcome"] == "invoice in_1 paid; organisation resumed"
    assert (await hook.org()).status == "active"
    async with hook.sm() as s:
        assert await s.get(StripeSuspension, hook.org_id) is None
        sync = await s.get(StripeInvoiceSync, inv.id)
        assert sync is not None and sync.paid_at is not None
        handled = {e.id: e.outcome for e in await s.scalars(select(StripeWebhookEvent))}
    assert handled == {
        failed["id"]: r.json()["outcome"],
        event("invoice.paid", "in_1")["id"]: paid.json()["outcome"],
    }
    assert await hook.key_events() == [KeysChanged(org_id=hook.org_id)] * 2


async def test_every_failed_invoice_must_be_paid(hook: Hook) -> None:
    assert (await hook.send(event("invoice.payment_failed", "in_1"))).status_code == 200
    r = await hook.send(event("invoice.payment_failed", "in_2"))
    assert r.json()["outcome"] == "payment of in_2 failed; organisation stays suspended"
    assert (await hook.send(event("invoice.paid", "in_1"))).json()["outcome"] == "invoice in_1 paid"
    assert (await hook.org()).status == "suspended"
    assert (await hook.send(event("invoice.paid", "in_2"))).json()["outcome"].endswith("organisation resumed")
    assert (await hook.org()).status == "active"


async def test_out_of_order_and_foreign_events(hook: Hook) -> None:
    # Stripe does not order deliveries: a failure reported after the payment is stale.
    assert (await hook.send(event("invoice.paid", "in_1"))).status_code == 200
    r = await hook.send(event("invoice.payment_failed", "in_1", event_id="evt_late_failure"))
    assert r.json()["outcome"] == "ignored: invoice in_1 is already paid"
    assert (await hook.org()).status == "active"
    # Someone else's customer, and events we do not act on.
    r = await hook.send(event("invoice.payment_failed", "in_9", customer="cus_unknown"))
    assert r.status_code == 200 and r.json()["outcome"].startswith("ignored")
    r = await hook.send(event("charge.refunded", "in_1"))
    assert r.status_code == 200 and r.json()["outcome"] == "ignored"
    assert (await hook.org()).status == "active" and await hook.key_events() == []


async def test_an_admins_suspension_is_not_lifted_by_a_payment(hook: Hook) -> None:
    async with hook.sm() as s, s.begin():
        org = await s.get(Organization, hook.org_id)
        assert org is not None
        org.status = "suspended"
    r = await hook.send(event("invoice.payment_failed", "in_1"))
    assert r.json()["outcome"] == "payment of in_1 failed; organisation was already suspended"
    assert (await hook.send(event("invoice.paid", "in_1"))).json()["outcome"] == "invoice in_1 paid"
    assert (await hook.org()).status == "suspended"


# --- through the gateway ----------------------------------------------------------------


async def test_gateway_refuses_a_suspended_organisation_at_once(gateway_env: Env) -> None:  # noqa: F811
    env = gateway_env
    env.app.state.settings.stripe_webhook_secret = SecretStr(SECRET)
    tenant = await env.tenant("globex")
    async with env.app.state.sessionmaker() as s, s.begin():
        org = await s.get(Organization, tenant.org_id)
        assert org is not None
        org.billing_mode, org.stripe_customer_id = "invoices", "cus_globex"

    async def models_status() -> int:
        return (await env.client.get("/v1/models", headers=tenant.headers)).status_code

    async def wait_for(status: int) -> None:
        # The change travels over the bus to the key cache; without it the cached record
        # would stay good for 30 s.
        for _ in range(100):
            if await models_status() == status:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"/v1/models never answered {status}")

    assert await models_status() == 200  # the key record is now cached
    payload = json.dumps(event("invoice.payment_failed", "in_g1", customer="cus_globex")).encode()
    r = await env.client.post(
        "/webhooks/stripe", content=payload, headers={"stripe-signature": FakeStripe.sign(payload, SECRET)}
    )
    assert r.status_code == 200, r.text
    await wait_for(403)
    refused = await env.client.get("/v1/models", headers=tenant.headers)
    assert refused.json()["error"]["code"] == "organization_suspended"

    payload = json.dumps(event("invoice.paid", "in_g1", customer="cus_globex")).encode()
    r = await env.client.post(
        "/webhooks/stripe", content=payload, headers={"stripe-signature": FakeStripe.sign(payload, SECRET)}
    )
    assert r.status_code == 200, r.text
    await wait_for(200)
    # The webhook is not part of the public API's document.
    document = await env.client.get("/openapi.json")
    assert document.status_code == 200 and "/v1/models" in document.json()["paths"]
    assert not [path for path in document.json()["paths"] if path.startswith("/webhooks")]
