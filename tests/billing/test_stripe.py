"""Stripe sync against a local fake Stripe server (tests/billing/fake_stripe.py), through the
official SDK unmodified: customers, `invoices` mode, `meters` mode, never both, and reruns,
replays and interrupted runs that change nothing. SQLite and PostgreSQL.

The usage lives in January 2025 (billing_world); the fake's clock is moved to the start of
February so Stripe's 35-day window for meter event timestamps holds.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import stripe
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from billing.jobs import finalize_invoices, rollup_hours
from billing.ledger.services import record_usage
from billing.models import Invoice, StripeInvoiceSync, StripeMeterEvent
from billing.stripe.client import minor_units, stripe_client
from billing.stripe.invoicing import ensure_customers, sync_invoices
from billing.stripe.metering import send_meter_events
from billing.stripe.services import sync_stripe
from control_plane.orgs.models import Organization
from tests.billing.billing_world import (
    FEB,
    JAN,
    MONTH,
    World,
    add_gpu_price,
    add_model_price,
    add_usage,
    add_worker,
    make_world,
    t,
)
from tests.billing.fake_stripe import API_KEY, FakeStripe, parse_form
from tokenmill.protocol import UsageRecord
from tokenmill.settings import Settings

# The SDK hands httpx its form body as `data=<str>`, which httpx deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

Sessions = async_sessionmaker[AsyncSession]
# An hour after January's last hour closed: every hour of January is sendable.
NOW = FEB + timedelta(hours=1)
CUSTOMERS, INVOICES, ITEMS, METER_EVENTS = (
    "/v1/customers",
    "/v1/invoices",
    "/v1/invoiceitems",
    "/v1/billing/meter_events",
)


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe() as server:
        server.clock = lambda: FEB.timestamp()
        yield server


def settings_for(fake: FakeStripe) -> Settings:
    return Settings(stripe_api_key=API_KEY, stripe_api_base=fake.url)


@pytest.fixture
async def client(fake: FakeStripe) -> AsyncIterator[stripe.StripeClient]:
    async with stripe_client(settings_for(fake)) as c:
        yield c


@pytest.fixture
async def world(migrated_db: Sessions) -> tuple[World, list[dict[str, Any]]]:
    """Two tenants with January usage: org A on the small model (prices with fractions of a
    cent per request) plus a dedicated deployment that ran 2 h 15 min; org B on the big one."""
    sm = migrated_db
    w = await make_world(sm)
    await add_model_price(sm, w.small, JAN, input="0.15", cached="0.075", output="0.6")
    await add_model_price(sm, w.big, JAN, input="3", cached="1.5", output="15")
    await add_gpu_price(sm, "a100", JAN, "2.21")
    rows = []
    for i in range(12):
        rows.append(
            w.usage(
                w.org_a, w.small_dep, t(3 + i % 3, i, 7), prompt=1000 + 37 * i, cached=200, output=321 + i
            )
        )
        rows.append(
            w.usage(w.org_b, w.big_dep, t(10 + i % 2, 2 * i, 30), prompt=5000 + i, cached=10 * i, output=777)
        )
    # Tokens on the dedicated deployment: paid by its GPU time, never per token.
    rows.append(w.usage(w.org_a, w.dedicated, t(4, 2, 10), prompt=999, output=111))
    await add_usage(sm, rows)
    await add_worker(sm, "w-ded", w.dedicated, t(4, 1, 30), stopped=t(4, 3, 45), gpu_type="a100")
    return w, rows


async def set_mode(sm: Sessions, org_id: str, mode: str) -> None:
    async with sm() as s, s.begin():
        await s.execute(update(Organization).where(Organization.id == org_id).values(billing_mode=mode))


async def customer_of(sm: Sessions, org_id: str) -> str | None:
    async with sm() as s:
        return await s.scalar(select(Organization.stripe_customer_id).where(Organization.id == org_id))


async def invoice_of(sm: Sessions, org_id: str) -> Invoice:
    async with sm() as s:
        inv = await s.scalar(
            select(Invoice).options(selectinload(Invoice.lines)).where(Invoice.org_id == org_id)
        )
        assert inv is not None
        return inv


async def sync_row(sm: Sessions, invoice_id: str) -> StripeInvoiceSync | None:
    async with sm() as s:
        return await s.get(StripeInvoiceSync, invoice_id)


async def replay_everything(sm: Sessions, rows: list[dict[str, Any]]) -> None:
    """The same usage events delivered again, and rollups and invoices run again."""
    records = [
        UsageRecord(
            request_id=r["request_id"],
            org_id=r["org_id"],
            model=r["model"],
            deployment_id=r["deployment_id"],
            prompt_tokens=r["prompt_tokens"],
            cached_tokens=r["cached_tokens"],
            completion_tokens=r["completion_tokens"],
            ts=r["created_at"].timestamp(),
        )
        for r in rows
    ]
    async with sm() as s, s.begin():
        assert await record_usage(s, records) == 0
    stats = await rollup_hours(sm, JAN, FEB)
    assert (stats.inserted, stats.updated, stats.deleted) == (0, 0, 0)
    again = await finalize_invoices(sm, MONTH)
    assert again.finalized == []


# --- the fake speaks Stripe -------------------------------------------------------------


def test_form_encoding_is_parsed_as_stripe_nests_it() -> None:
    pairs = [
        ("customer", "cus_1"),
        ("metadata[org_id]", "org_1"),
        ("lines[0][amount]", "100"),
        ("lines[0][metadata][k]", "v"),
        ("lines[1][amount]", "250"),
        ("expand[0]", "lines"),
    ]
    assert parse_form(pairs) == {
        "customer": "cus_1",
        "metadata": {"org_id": "org_1"},
        "lines": [{"amount": "100", "metadata": {"k": "v"}}, {"amount": "250"}],
        "expand": ["lines"],
    }


async def test_fake_stripe_auth_idempotency_and_errors(fake: FakeStripe, client: stripe.StripeClient) -> None:
    first = await client.v1.customers.create_async({"name": "a"}, {"idempotency_key": "k"})
    again = await client.v1.customers.create_async({"name": "a"}, {"idempotency_key": "k"})
    assert again.id == first.id and len(fake.customers) == 1
    assert [c.replayed for c in fake.calls] == [False, True]
    with pytest.raises(stripe.IdempotencyError):  # same key, other parameters
        await client.v1.customers.create_async({"name": "b"}, {"idempotency_key": "k"})
    with pytest.raises(stripe.InvalidRequestError) as missing:
        await client.v1.invoices.create_async({"customer": "cus_nope"})
    assert missing.value.code == "resource_missing" and missing.value.http_status == 400
    async with stripe_client(Settings(stripe_api_key="sk_test_wrong", stripe_api_base=fake.url)) as bad:
        with pytest.raises(stripe.AuthenticationError):
            await bad.v1.customers.create_async({"name": "x"})
    # Every request was form-encoded with a bearer key: the fake would have refused otherwise.
    assert [c.status for c in fake.calls] == [200, 200, 400, 400, 401]


# --- customers --------------------------------------------------------------------------


async def test_one_customer_per_organisation_with_a_mode(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, _) = migrated_db, world
    await set_mode(sm, w.org_a, "invoices")
    await set_mode(sm, w.org_b, "meters")
    assert await ensure_customers(sm, client) == 2
    assert await ensure_customers(sm, client) == 0  # a rerun asks Stripe nothing
    created = fake.created("POST", CUSTOMERS)
    assert sorted(c.params["metadata"]["org_id"] for c in created) == sorted([w.org_a, w.org_b])
    assert all(c.idempotency_key == f"tokenmill-customer-{c.params['metadata']['org_id']}" for c in created)
    a, b = await customer_of(sm, w.org_a), await customer_of(sm, w.org_b)
    assert a and b and a != b and {a, b} == set(fake.customers)

    # A run that created the customer but died before recording it: the next run finds it.
    async with sm() as s, s.begin():
        await s.execute(
            update(Organization).where(Organization.id == w.org_a).values(stripe_customer_id=None)
        )
    fake._idempotency.clear()  # ...and long enough ago that Stripe forgot the idempotency key
    assert await ensure_customers(sm, client) == 1
    assert await customer_of(sm, w.org_a) == a
    assert len(fake.created("POST", CUSTOMERS)) == 2 and len(fake.customers) == 2


async def test_organisations_without_a_mode_are_left_alone(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm = migrated_db
    stats = await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    assert (stats.customers, stats.invoices, stats.meter_events) == (0, 0, 0)
    assert fake.calls == []
    unconfigured = await sync_stripe(sm, Settings(stripe_api_key=None))
    assert not unconfigured.configured


# --- invoices mode ----------------------------------------------------------------------


async def test_invoices_mode_mirrors_each_finalized_invoice_once(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, rows) = migrated_db, world
    await set_mode(sm, w.org_a, "invoices")
    await rollup_hours(sm, JAN, FEB)
    await ensure_customers(sm, client)
    assert await sync_invoices(sm, client) == 0  # drafts are not mirrored
    await finalize_invoices(sm, MONTH)
    assert await sync_invoices(sm, client) == 1  # org B has no mode: its invoice stays local

    local = await invoice_of(sm, w.org_a)
    customer = await customer_of(sm, w.org_a)
    (created,) = fake.created("POST", INVOICES)
    assert created.params["customer"] == customer
    assert created.params["metadata"]["tokenmill_invoice_id"] == local.id
    assert created.params["pending_invoice_items_behavior"] == "exclude"
    assert created.idempotency_key == f"tokenmill-invoice-{local.id}"
    remote = fake.invoices[created.response["id"]]

    # One item per local line, exactly its amount in cents (fractions of a cent exist in
    # the usage, so the lines carry real half-even rounding).
    items = fake.created("POST", ITEMS)
    assert len(local.lines) >= 4
    assert any(line.amount != line.amount.to_integral_value() for line in local.lines)
    assert sorted(
        (c.params["metadata"]["tokenmill_line_id"], int(c.params["amount"])) for c in items
    ) == sorted((str(line.id), int(line.amount * 100)) for line in local.lines)
    assert all(c.params["invoice"] == remote["id"] and c.params["currency"] == "usd" for c in items)
    assert remote["status"] == "open" and remote["total"] == int(local.total * 100) > 0
    assert len(fake.created("POST", f"{INVOICES}/{remote['id']}/finalize")) == 1
    row = await sync_row(sm, local.id)
    assert row is not None and (row.status, row.stripe_invoice_id, row.stripe_total) == (
        "finalized",
        remote["id"],
        remote["total"],
    )

    # Replayed events, rerun rollups and invoices, rerun sync: Stripe hears nothing more.
    seen = len(fake.calls)
    await replay_everything(sm, rows)
    stats = await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    assert (stats.customers, stats.invoices, stats.meter_events) == (0, 0, 0)
    assert len(fake.calls) == seen
    assert len(fake.invoices) == 1 and len(fake.invoice_items) == len(local.lines)


async def test_an_interrupted_invoice_sync_resumes_without_duplicates(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, _) = migrated_db, world
    await set_mode(sm, w.org_a, "invoices")
    await rollup_hours(sm, JAN, FEB)
    await finalize_invoices(sm, MONTH)
    await ensure_customers(sm, client)
    local = await invoice_of(sm, w.org_a)

    # Stripe fails on the third item (and on the SDK's two retries of it): the run stops there.
    fake.fail("POST", ITEMS, times=3, after=2)
    assert await sync_invoices(sm, client) == 0
    row = await sync_row(sm, local.id)
    assert row is not None and row.status == "created" and row.stripe_invoice_id
    assert fake.invoices[row.stripe_invoice_id]["status"] == "draft"
    assert len(fake.invoices[row.stripe_invoice_id]["lines"]["data"]) == 2

    # Worse: the run that created the Stripe invoice never recorded its id, and the
    # idempotency keys have expired. The next run finds the invoice by its metadata.
    async with sm() as s, s.begin():
        await s.execute(
            update(StripeInvoiceSync)
            .where(StripeInvoiceSync.invoice_id == local.id)
            .values(status="pending", stripe_invoice_id=None)
        )
    fake._idempotency.clear()
    assert await sync_invoices(sm, client) == 1
    assert len(fake.created("POST", INVOICES)) == 1 and len(fake.invoices) == 1
    remote = fake.invoices[row.stripe_invoice_id]
    line_ids = [line["metadata"]["tokenmill_line_id"] for line in remote["lines"]["data"]]
    assert sorted(line_ids) == sorted(str(line.id) for line in local.lines)  # each line once
    assert remote["status"] == "open" and remote["total"] == minor_units(local.total, "usd")
    assert await sync_invoices(sm, client) == 0


# --- meters mode ------------------------------------------------------------------------


def expected_meters(w: World, rows: list[dict[str, Any]], org_id: str) -> dict[tuple[int, str, str], Decimal]:
    """From the raw ledger rows and the worker's lifetime, independently of the rollups:
    (hour timestamp, model, event name) -> value."""
    out: dict[tuple[int, str, str], Decimal] = defaultdict(Decimal)
    for r in rows:
        if r["org_id"] != org_id or r["deployment_id"] == w.dedicated:
            continue
        hour = int(r["created_at"].replace(minute=0, second=0, microsecond=0).timestamp())
        model = "small-model" if r["deployment_id"] == w.small_dep else "big-model"
        # Requests run in a batch go on the batch meters.
        prefix = "tokenmill_batch_" if r.get("batch_id") else "tokenmill_"
        for name, value in (
            ("input_tokens", r["prompt_tokens"] - r["cached_tokens"]),
            ("cached_input_tokens", r["cached_tokens"]),
            ("output_tokens", r["completion_tokens"]),
        ):
            if value:
                out[hour, model, prefix + name] += value
    if org_id == w.org_a:  # the dedicated worker: 01:30-03:45 on January 4th
        for hour, seconds in ((1, 1800), (2, 3600), (3, 2700)):
            out[int(t(4, hour).timestamp()), "big-model", "tokenmill_gpu_seconds"] += seconds
    return dict(out)


def stripe_meters(fake: FakeStripe, customer: str | None = None) -> dict[tuple[int, str, str], Decimal]:
    """What Stripe counted (deduplicated by identifier), summed like a meter."""
    out: dict[tuple[int, str, str], Decimal] = defaultdict(Decimal)
    for ev in fake.meter_events.values():
        if customer is None or ev["payload"]["stripe_customer_id"] == customer:
            out[ev["timestamp"], ev["payload"]["model"], ev["event_name"]] += Decimal(ev["payload"]["value"])
    return dict(out)


async def test_meters_mode_sends_each_identifier_once(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, rows) = migrated_db, world
    await set_mode(sm, w.org_a, "meters")
    await set_mode(sm, w.org_b, "invoices")
    await rollup_hours(sm, JAN, FEB)
    await finalize_invoices(sm, MONTH)
    stats = await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    a, b = await customer_of(sm, w.org_a), await customer_of(sm, w.org_b)
    events = fake.created("POST", METER_EVENTS)
    identifiers = [c.params["identifier"] for c in events]
    assert stats.meter_events == len(events) == len(set(identifiers)) > 0
    assert all(c.idempotency_key == f"tokenmill-meter-{c.params['identifier']}" for c in events)
    # Exactly org A's usage, dedicated tokens left out, its GPU time in.
    assert stripe_meters(fake) == stripe_meters(fake, a) == expected_meters(w, rows, w.org_a)
    # Never both: org A (meters) has no Stripe invoice, org B (invoices) no meter events.
    assert stats.invoices == 1
    assert [inv["customer"] for inv in fake.invoices.values()] == [b]

    # Rerun and replay: nothing new reaches Stripe.
    seen = len(fake.calls)
    await replay_everything(sm, rows)
    stats = await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    assert (stats.customers, stats.invoices, stats.meter_events) == (0, 0, 0)
    assert len(fake.calls) == seen

    # Usage that reaches the ledger late, for an hour already sent and for a new hour:
    # only the differences go, under new identifiers.
    late = [
        w.usage(w.org_a, w.small_dep, t(3, 0, 59), prompt=10, output=5),
        w.usage(w.org_a, w.small_dep, t(20, 8, 0), prompt=7, cached=3, output=1),
    ]
    await add_usage(sm, late)
    await rollup_hours(sm, JAN, FEB)
    assert await send_meter_events(sm, client, now=NOW) == 2 + 3
    identifiers = [c.params["identifier"] for c in fake.created("POST", METER_EVENTS)]
    assert len(identifiers) == len(set(identifiers))
    assert Counter(i.rsplit("-", 1)[1] for i in identifiers[-5:]) == {"1": 2, "0": 3}
    assert stripe_meters(fake) == expected_meters(w, rows + late, w.org_a)
    assert await send_meter_events(sm, client, now=NOW) == 0


async def test_meter_events_survive_failures_and_lost_commits(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, rows) = migrated_db, world
    await set_mode(sm, w.org_a, "meters")
    await rollup_hours(sm, JAN, FEB)
    await ensure_customers(sm, client)

    # Stripe fails one event (and the SDK's retries): it stays pending, the rest go.
    fake.fail("POST", METER_EVENTS, times=3, after=1)
    sent = await send_meter_events(sm, client, now=NOW)
    async with sm() as s:
        local = list(await s.scalars(select(StripeMeterEvent)))
    pending = [e.identifier for e in local if e.status == "pending"]
    assert len(pending) == 1 and sent == len(local) - 1

    # The next run sends that very identifier with its recorded value, and nothing else new.
    assert await send_meter_events(sm, client, now=NOW) == 1
    assert fake.created("POST", METER_EVENTS)[-1].params["identifier"] == pending[0]
    assert set(fake.meter_events) == {e.identifier for e in local}
    assert stripe_meters(fake) == expected_meters(w, rows, w.org_a)

    # A run whose "sent" commit was lost resends; Stripe counts each identifier once,
    # whether it replays the idempotency key or (a day later) dedupes the identifier.
    async with sm() as s, s.begin():
        await s.execute(update(StripeMeterEvent).values(status="pending"))
    assert await send_meter_events(sm, client, now=NOW) == len(local)
    fake._idempotency.clear()
    async with sm() as s, s.begin():
        await s.execute(update(StripeMeterEvent).values(status="pending"))
    assert await send_meter_events(sm, client, now=NOW) == len(local)
    assert len(fake.meter_events) == len(local)
    assert stripe_meters(fake) == expected_meters(w, rows, w.org_a)


async def test_switching_modes_never_bills_a_period_twice(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, _) = migrated_db, world
    await set_mode(sm, w.org_a, "meters")
    await set_mode(sm, w.org_b, "invoices")
    await rollup_hours(sm, JAN, FEB)
    await finalize_invoices(sm, MONTH)
    await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    a, b = await customer_of(sm, w.org_a), await customer_of(sm, w.org_b)
    metered, invoiced = stripe_meters(fake), dict(fake.invoices)

    # Both organisations swap modes after January was billed.
    await set_mode(sm, w.org_a, "invoices")
    await set_mode(sm, w.org_b, "meters")
    stats = await sync_stripe(sm, settings_for(fake), client=client, now=NOW)
    assert (stats.invoices, stats.meter_events) == (0, 0)
    # Org A's January went as meter events: its January invoice is not mirrored.
    assert not [inv for inv in fake.invoices.values() if inv["customer"] == a]
    assert (await sync_row(sm, (await invoice_of(sm, w.org_a)).id)) is None
    # Org B's January is on a Stripe invoice: its hours are not metered.
    assert stripe_meters(fake, b) == {}
    assert stripe_meters(fake) == metered and fake.invoices.keys() == invoiced.keys()


def batch_rows(w: World) -> list[dict[str, Any]]:
    """Org A's batches: one sharing an hour (and model) with its online requests, one in an
    hour of its own, one on the dedicated deployment (paid by GPU time, never per token)."""
    return [
        w.usage(
            w.org_a, w.small_dep, t(3, 0, 30), prompt=10**6, cached=400_000, output=50_000, batch_id="batch_1"
        ),
        w.usage(w.org_a, w.small_dep, t(3, 0, 40), prompt=20, output=3, batch_id="batch_1"),
        w.usage(w.org_a, w.small_dep, t(7, 5), prompt=300, output=70, batch_id="batch_2"),
        w.usage(w.org_a, w.dedicated, t(4, 2, 20), prompt=500, output=5, batch_id="batch_3"),
    ]


async def test_meters_mode_sends_batch_usage_on_batch_meters(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, rows) = migrated_db, world
    batches = batch_rows(w)
    await add_usage(sm, batches)
    await set_mode(sm, w.org_a, "meters")
    await rollup_hours(sm, JAN, FEB)
    await ensure_customers(sm, client)
    assert await send_meter_events(sm, client, now=NOW) > 0
    sent = stripe_meters(fake)
    assert sent == expected_meters(w, rows + batches, w.org_a)
    # The hour org A used both ways: online and batch tokens on meters of their own.
    hour = int(t(3, 0).timestamp())
    assert {k[2]: v for k, v in sent.items() if k[0] == hour} == {
        "tokenmill_input_tokens": Decimal(800),
        "tokenmill_cached_input_tokens": Decimal(200),
        "tokenmill_output_tokens": Decimal(321),
        "tokenmill_batch_input_tokens": Decimal(600_020),
        "tokenmill_batch_cached_input_tokens": Decimal(400_000),
        "tokenmill_batch_output_tokens": Decimal(50_003),
    }
    assert {k[2]: v for k, v in sent.items() if k[0] == int(t(7, 5).timestamp())} == {
        "tokenmill_batch_input_tokens": Decimal(300),
        "tokenmill_batch_output_tokens": Decimal(70),
    }
    identifiers = [c.params["identifier"] for c in fake.created("POST", METER_EVENTS)]
    assert len(identifiers) == len(set(identifiers))
    assert any("-batch_cached_input-" in i for i in identifiers)
    async with sm() as s:
        local = {e.meter for e in await s.scalars(select(StripeMeterEvent))}
    assert local == {"input", "cached_input", "output", "gpu_seconds"} | {
        "batch_input",
        "batch_cached_input",
        "batch_output",
    }
    assert await send_meter_events(sm, client, now=NOW) == 0  # a rerun sends nothing


async def test_invoices_mode_mirrors_batch_lines_as_items(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
) -> None:
    sm, (w, _) = migrated_db, world
    await add_usage(sm, batch_rows(w))
    await set_mode(sm, w.org_a, "invoices")
    await rollup_hours(sm, JAN, FEB)
    await finalize_invoices(sm, MONTH)
    await ensure_customers(sm, client)
    assert await sync_invoices(sm, client) == 1
    local = await invoice_of(sm, w.org_a)
    batch = [line for line in local.lines if line.meter.startswith("batch_")]
    # Half the small model's prices (0.15, 0.075, 0.6): 600,320 x 0.075 = 0.045024 -> 0.05;
    # 400,000 x 0.0375 = 0.015 -> 0.02; 50,073 x 0.3 = 0.0150219 -> 0.02.
    assert [(x.meter, x.quantity, x.unit_price, x.amount) for x in batch] == [
        ("batch_input", Decimal(600_320), Decimal("0.075"), Decimal("0.05")),
        ("batch_cached_input", Decimal(400_000), Decimal("0.0375"), Decimal("0.02")),
        ("batch_output", Decimal(50_073), Decimal("0.3"), Decimal("0.02")),
    ]
    items = {c.params["metadata"]["tokenmill_line_id"]: c.params for c in fake.created("POST", ITEMS)}
    assert sorted(items) == sorted(str(line.id) for line in local.lines)
    for line in batch:
        item = items[str(line.id)]
        assert (item["metadata"]["meter"], item["description"], int(item["amount"])) == (
            line.meter,
            line.description,
            minor_units(line.amount, "usd"),
        )
        assert "batch" in item["description"]
    remote = fake.invoices[(await sync_row(sm, local.id)).stripe_invoice_id]  # type: ignore[union-attr]
    assert remote["total"] == minor_units(local.total, "usd")


def test_amounts_in_the_smallest_currency_unit() -> None:
    assert minor_units(Decimal("12.34"), "usd") == 1234
    assert minor_units(Decimal("-0.05"), "EUR") == -5
    assert minor_units(Decimal("1500"), "jpy") == 1500
    assert minor_units(Decimal("1.25"), "kwd") == 1250
    with pytest.raises(ValueError):
        minor_units(Decimal("0.005"), "usd")  # never rounded here: lines are rounded once
    with pytest.raises(ValueError):
        minor_units(Decimal("10.50"), "jpy")


def test_meter_identifiers_are_deterministic_and_short() -> None:
    from billing.stripe.metering import meter_identifier

    hour = datetime(2025, 1, 3, 7, tzinfo=UTC)
    first = meter_identifier("org_" + "a" * 20, hour, "m" * 200, "cached_input", 12)
    assert first == meter_identifier("org_" + "a" * 20, hour, "m" * 200, "cached_input", 12)
    assert len(first) <= 100 and first.endswith("-12")
    assert first != meter_identifier("org_" + "a" * 20, hour, "m" * 199, "cached_input", 12)


async def test_no_secret_reaches_the_logs(
    migrated_db: Sessions,
    world: tuple[World, list[dict[str, Any]]],
    fake: FakeStripe,
    client: stripe.StripeClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sm, (w, _) = migrated_db, world
    caplog.set_level(logging.DEBUG)  # the SDK's own request logging included
    settings = settings_for(fake)
    assert API_KEY not in repr(settings) and API_KEY not in str(settings.model_dump())
    await set_mode(sm, w.org_a, "invoices")
    await set_mode(sm, w.org_b, "meters")
    await rollup_hours(sm, JAN, FEB)
    await finalize_invoices(sm, MONTH)
    fake.fail("POST", ITEMS, times=3)  # errors are logged too
    await sync_stripe(sm, settings, now=NOW)  # with its own client, from the settings
    await sync_stripe(sm, settings, now=NOW)
    assert fake.invoices and fake.meter_events and "could not mirror" in caplog.text
    async with stripe_client(Settings(stripe_api_key=API_KEY + "x", stripe_api_base=fake.url)) as bad:
        await ensure_customers(sm, bad)  # nothing to do: no request, nothing to leak
        with pytest.raises(stripe.AuthenticationError):
            await bad.v1.customers.create_async({"name": "x"})
    assert API_KEY not in caplog.text
