"""Monthly invoices from the rollups: exact to the cent against the ledger, half-even
rounding per line, prices changing mid-month, GPU-hours of dedicated deployments, drafts
rebuilt idempotently, finalized invoices numbered and frozen. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from billing.common import cents, month_bounds
from billing.invoices.services import finalize_invoice
from billing.jobs import build_invoices, finalize_invoices, rollup_hours
from billing.models import Invoice, UsageEvent
from billing.prices.services import Rates, batch_price, model_rates
from billing.rollups.services import spend_since
from control_plane.catalog.lifetimes import WorkerLifetimes
from control_plane.catalog.models import Deployment, Worker
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
from tokenmill.bus import MemoryBus
from tokenmill.errors import APIError
from tokenmill.protocol import WorkerAnnounce, WorkerDeparture


@pytest.fixture
async def world(migrated_db: async_sessionmaker[AsyncSession]) -> World:
    return await make_world(migrated_db)


async def _invoices(sm: async_sessionmaker[AsyncSession]) -> dict[str, Invoice]:
    async with sm() as s:
        found = await s.scalars(select(Invoice).options(selectinload(Invoice.lines)))
        return {i.org_id: i for i in found}


def _snapshot(invoices: dict[str, Invoice]) -> list[tuple[Any, ...]]:
    return [
        (
            i.id,
            i.org_id,
            i.status,
            i.number,
            i.subtotal,
            i.total,
            i.updated_at,
            [(x.id, x.position, x.description, x.quantity, x.unit_price, x.amount) for x in i.lines],
        )
        for i in sorted(invoices.values(), key=lambda i: i.org_id)
    ]


async def _close(sm: async_sessionmaker[AsyncSession]) -> None:
    await rollup_hours(sm, JAN, FEB)
    await build_invoices(sm, MONTH)


def test_half_even_to_the_cent() -> None:
    cases = {
        "0.005": "0.00",  # halves go to the even cent...
        "0.015": "0.02",
        "0.025": "0.02",
        "0.035": "0.04",
        "2.675": "2.68",
        "1.0050000001": "1.01",  # ...anything above half goes up
        "1.0049999999": "1.00",
        "-0.005": "-0.00",
    }
    for amount, expected in cases.items():
        assert cents(Decimal(amount)) == Decimal(expected), amount
    assert Decimal("0.025").quantize(Decimal("0.01"), ROUND_HALF_UP) == Decimal("0.03")  # not this


async def test_lines_round_half_even_once_per_line(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    # 25,000 input tokens at 1.00 per million = 0.025 exactly: half-even gives 0.02. Split
    # over many hours, per-hour rounding would give 0.00 (25 x 0.001): lines round once.
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(2, h), 1000) for h in range(24)])
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(3, 0), 1000)])
    # 15,000 output tokens = 0.015 -> 0.02; 5,000 cached = 0.005 -> 0.00.
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(4), 5000, 5000, 15000)])
    await _close(sm)
    invoice = (await _invoices(sm))[w.org_a]
    amounts = {x.meter: (x.quantity, x.amount) for x in invoice.lines}
    assert amounts == {
        "input": (Decimal(25000), Decimal("0.02")),
        "cached_input": (Decimal(5000), Decimal("0.00")),
        "output": (Decimal(15000), Decimal("0.02")),
    }
    assert invoice.subtotal == invoice.total == Decimal("0.04")


async def test_reconciles_with_the_ledger_to_the_cent(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    """Many requests at prices with many decimals, changing twice in the month: the invoice
    total is the ledger's tokens x the price in effect at each request, each line rounded."""
    w, sm = world, migrated_db
    rng = random.Random(5)
    versions = {
        w.small: [(JAN, "0.123456789", "0.061728394", "0.987654321"), (t(11, 7, 13), "0.2", "0.1", "1.1")],
        w.big: [
            (JAN, "3.333333333", "1.111111111", "9.999999999"),
            (t(20, 23, 59, 59), "2.5", "1.25", "7.5"),
        ],
    }
    for model, vs in versions.items():
        for at, inp, cached, out in vs:
            await add_model_price(sm, model, at, inp, cached, out)
    deps = {w.small_dep: w.small, w.big_dep: w.big}
    rows = []
    for _ in range(3000):
        org = rng.choice([w.org_a, w.org_b])
        dep = rng.choice(list(deps))
        at = JAN + timedelta(seconds=rng.randrange(31 * 86400), microseconds=rng.randrange(10**6))
        prompt = rng.randrange(1, 5000)
        adapter = w.adapter if org == w.org_a and dep == w.small_dep and rng.random() < 0.3 else None
        rows.append(
            w.usage(org, dep, at, prompt, rng.randrange(prompt + 1), rng.randrange(2000), adapter=adapter)
        )
    # Outside the month: not on January's invoice.
    rows.append(w.usage(w.org_a, w.small_dep, FEB, 10**6, 0, 10**6))
    rows.append(w.usage(w.org_a, w.small_dep, JAN - timedelta(microseconds=1), 10**6, 0, 10**6))
    await add_usage(sm, rows)
    await _close(sm)

    # The expectation, from the ledger alone.
    def price(model: str, at: datetime) -> tuple[Decimal, ...]:
        current = [v for v in versions[model] if v[0] <= at][-1]
        return tuple(Decimal(x) for x in current[1:])

    lines: dict[tuple[str, str, str | None, str, Decimal], int] = defaultdict(int)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    async with sm() as s:
        ledger = await s.scalars(
            select(UsageEvent).where(UsageEvent.created_at >= JAN, UsageEvent.created_at < FEB)
        )
        for e in ledger:
            model = deps[e.deployment_id]
            p_in, p_cached, p_out = price(model, e.created_at.astimezone(UTC))
            for meter, qty, p in (
                ("input", e.prompt_tokens - e.cached_tokens, p_in),
                ("cached_input", e.cached_tokens, p_cached),
                ("output", e.completion_tokens, p_out),
            ):
                lines[e.org_id, model, e.adapter, meter, p] += qty
                tokens[e.org_id, meter] += qty
    expected: dict[str, Decimal] = defaultdict(Decimal)
    for (org, _m, _a, _meter, p), qty in lines.items():
        if qty:
            expected[org] += (qty * p / 10**6).quantize(Decimal("0.01"), ROUND_HALF_EVEN)

    invoices = await _invoices(sm)
    assert set(invoices) == {w.org_a, w.org_b}
    for org, invoice in invoices.items():
        assert invoice.total == invoice.subtotal == expected[org], org
        assert invoice.total == sum(x.amount for x in invoice.lines)
        assert invoice.currency == "usd" and invoice.status == "draft" and invoice.number is None
        assert (invoice.period_start, invoice.period_end) == month_bounds(MONTH)
        for meter in ("input", "cached_input", "output"):
            assert sum(x.quantity for x in invoice.lines if x.meter == meter) == tokens[org, meter]
    # Two price versions of each model, some lines with the adapter: more than 6 lines.
    assert len(invoices[w.org_a].lines) > 12
    assert any("with adapter acme-lora" in x.description for x in invoices[w.org_a].lines)


async def test_gpu_hours_of_dedicated_deployments(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.big, JAN, "5", "5", "5")  # dedicated tokens: not charged
    await add_gpu_price(sm, "a100", JAN, "2.50")
    await add_gpu_price(sm, "a100", t(20), "3.00")
    await add_worker(sm, "w1", w.dedicated, t(10, 10, 15, 30, 250000), stopped=t(10, 13, 5))
    await add_worker(
        sm, "w2", w.dedicated, t(20, 23, 59, 59), last_seen=t(21, 0, 30, 0, 500000), status="lost"
    )
    await add_worker(sm, "w3", w.dedicated, t(31, 23), stopped=t(32, 1))
    await add_usage(sm, [w.usage(w.org_a, w.dedicated, t(10, 11), 10**6, 0, 10**6)])
    await _close(sm)
    invoice = (await _invoices(sm))[w.org_a]
    got = [(x.meter, x.quantity, x.unit_price, x.amount) for x in invoice.lines]
    # 10169.75 s x 2.50 / 3600 = 7.0623263... -> 7.06; (1801.5 + 3600) s x 3.00 / 3600 = 4.50125 -> 4.50
    assert got == [
        ("gpu_seconds", Decimal("10169.75"), Decimal("2.5"), Decimal("7.06")),
        ("gpu_seconds", Decimal("5401.5"), Decimal("3"), Decimal("4.50")),
    ]
    assert invoice.total == Decimal("11.56")
    assert invoice.lines[0].description == (
        "Dedicated deployment acme-big (big-model, a100): GPU time at 2.50 USD per GPU-hour"
    )
    assert w.org_b not in await _invoices(sm)


async def test_gpu_hours_are_lifetime_times_gpus_per_replica_times_price(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    """A dedicated vLLM deployment spanning 4 GPUs, recorded from the bus as in production:
    each worker keeps the GPU count its deployment had when it joined."""
    w, sm = world, migrated_db

    async def gpus(n: int, args: dict[str, int]) -> None:
        async with sm() as s, s.begin():
            dep = await s.get(Deployment, w.dedicated)
            assert dep is not None
            dep.engine, dep.engine_args, dep.gpus_per_replica = "vllm", args, n

    await gpus(4, {"tensor_parallel_size": 4})
    await add_gpu_price(sm, "a100", JAN, "2.50")
    await add_gpu_price(sm, "a100", t(4), "3.00")
    lifetimes = WorkerLifetimes(MemoryBus(), sm, "test")

    async def lifetime(worker: str, start: datetime, stop: datetime) -> None:
        await lifetimes.apply(
            [
                WorkerAnnounce(
                    worker, w.dedicated, f"http://{worker}", "m", gpu_type="a100", ts=start.timestamp()
                ),
                WorkerDeparture(worker, w.dedicated, ts=stop.timestamp()),
            ]
        )

    await lifetime("v1", t(3, 10), t(3, 11, 30))  # 1.5 h on 4 GPUs at 2.50
    await gpus(2, {"tensor_parallel_size": 2})  # hours already run keep their 4 GPUs
    await lifetime("v2", t(5, 8), t(5, 9))  # 1 h on 2 GPUs at 3.00
    async with sm() as s:
        held = {x.id: x.gpus for x in await s.scalars(select(Worker))}
    assert held == {"v1": 4, "v2": 2}
    await _close(sm)
    invoice = (await _invoices(sm))[w.org_a]
    got = [(x.meter, x.quantity, x.unit_price, x.amount) for x in invoice.lines]
    assert got == [
        ("gpu_seconds", Decimal(5400 * 4), Decimal("2.5"), Decimal("15.00")),  # 1.5 x 4 x 2.50
        ("gpu_seconds", Decimal(3600 * 2), Decimal("3"), Decimal("6.00")),  # 1 x 2 x 3.00
    ]
    assert invoice.total == Decimal("21.00")


async def test_generation_is_idempotent_and_drafts_follow_the_rollups(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "1", "0.5", "2")
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(2), 10**6, 0, 10**6)])
    await rollup_hours(sm, JAN, FEB)
    first = await build_invoices(sm, MONTH)
    assert (len(first.created), first.updated, first.unchanged) == (1, [], [])
    before = _snapshot(await _invoices(sm))
    again = await build_invoices(sm, datetime(2025, 1, 17, tzinfo=UTC))  # any time in the month
    assert (again.created, again.updated, again.unchanged) == ([], [], first.created)
    assert _snapshot(await _invoices(sm)) == before  # not even updated_at moved

    await add_usage(
        sm, [w.usage(w.org_a, w.small_dep, t(3), 10**6, 0, 0), w.usage(w.org_b, w.small_dep, t(3), 10)]
    )
    await rollup_hours(sm, t(3), t(3, 1))
    third = await build_invoices(sm, MONTH)
    assert third.updated == first.created and len(third.created) == 1  # org B's first
    invoices = await _invoices(sm)
    assert invoices[w.org_a].id == first.created[0]  # the same draft, refreshed
    assert invoices[w.org_a].total == Decimal("4.00")
    assert invoices[w.org_b].total == Decimal("0.00")  # 10 tokens: a line of 0.00


async def test_finalize_numbers_freezes_and_is_a_no_op_twice(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    await add_usage(sm, [w.usage(org, w.small_dep, t(2), 10**6) for org in (w.org_a, w.org_b)])
    await rollup_hours(sm, JAN, FEB)
    stats = await finalize_invoices(sm, MONTH)
    assert len(stats.finalized) == 2 and stats.already == []
    invoices = await _invoices(sm)
    assert sorted(i.number for i in invoices.values()) == [1, 2]
    assert all(i.status == "finalized" and i.finalized_at is not None for i in invoices.values())
    frozen = _snapshot(invoices)

    again = await finalize_invoices(sm, MONTH)
    assert again.finalized == [] and sorted(again.already) == sorted(stats.finalized)
    assert sorted(again.build.finalized) == sorted(stats.finalized)
    # Late usage and a rebuild change the rollups, never a finalized invoice.
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(5), 10**6)])
    await rollup_hours(sm, JAN, FEB)
    await build_invoices(sm, MONTH)
    async with sm() as s, s.begin():
        _, changed = await finalize_invoice(s, invoices[w.org_a].id)
    assert not changed
    assert _snapshot(await _invoices(sm)) == frozen


async def test_an_open_month_is_not_finalized_unless_forced(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    now = datetime(2025, 1, 20, tzinfo=UTC)
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(2), 10**6)])
    await rollup_hours(sm, JAN, FEB)
    with pytest.raises(ValueError, match="not over"):
        await finalize_invoices(sm, MONTH, now=now)
    build = await build_invoices(sm, MONTH)
    async with sm() as s, s.begin():
        with pytest.raises(APIError) as err:
            await finalize_invoice(s, build.created[0], now=now)
    assert (err.value.status, err.value.code) == (409, "period_not_over")
    forced = await finalize_invoices(sm, MONTH, now=now, force=True)
    assert forced.finalized == build.created


# SQLite has one writer at a time: the race only exists on PostgreSQL.
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_concurrent_generation_makes_one_invoice(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    assert sm.kw["bind"].dialect.name == "postgresql"
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    await add_usage(sm, [w.usage(org, w.small_dep, t(2), 10**6) for org in (w.org_a, w.org_b)])
    await rollup_hours(sm, JAN, FEB)
    await asyncio.gather(*(build_invoices(sm, MONTH) for _ in range(4)))
    invoices = await _invoices(sm)
    assert len(invoices) == 2 and all(len(i.lines) == 1 for i in invoices.values())
    await asyncio.gather(*(finalize_invoices(sm, MONTH) for _ in range(3)))
    assert sorted(i.number for i in (await _invoices(sm)).values()) == [1, 2]


async def test_one_invoice_per_currency_and_gone_drafts_are_removed(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    await add_model_price(sm, w.big, JAN, "2", "2", "2", currency="eur")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(2), 10**6),
            w.usage(w.org_a, w.big_dep, t(2), 10**6),
            w.usage(w.org_b, w.big_dep, t(2), 10**6),
        ],
    )
    await _close(sm)
    async with sm() as s:
        found = {(i.org_id, i.currency): i.total for i in await s.scalars(select(Invoice))}
    assert found == {
        (w.org_a, "usd"): Decimal("1.00"),
        (w.org_a, "eur"): Decimal("2.00"),
        (w.org_b, "eur"): Decimal("2.00"),
    }
    # The big model is re-priced free from the start: its drafts have nothing left to bill.
    await add_model_price(sm, w.big, JAN + timedelta(microseconds=1), "0", "0", "0", currency="eur")
    await rollup_hours(sm, JAN, FEB)
    build = await build_invoices(sm, MONTH)
    assert len(build.deleted) == 2 and len(build.unchanged) == 1
    async with sm() as s:
        left = [(i.org_id, i.currency) for i in await s.scalars(select(Invoice))]
    assert left == [(w.org_a, "usd")]


# --- batch requests (/v1/batches) -------------------------------------------------------


def test_batch_unit_price_is_the_discounted_price_to_the_billionth() -> None:
    """The batch price is what an invoice line shows and multiplies: the token price less
    the discount, rounded half-even to the precision of prices. Budgets charge the same."""
    assert batch_price(Decimal("0.15"), Decimal("0.5")) == Decimal("0.075")
    assert batch_price(Decimal("3"), Decimal("0.25")) == Decimal("2.25")
    assert batch_price(Decimal("0.123456789"), Decimal("0.25")) == Decimal("0.092592592")  # ..5917|5
    assert batch_price(Decimal("0.000000001"), Decimal("0.5")) == Decimal(0)  # half: to even
    assert batch_price(Decimal("0.000000003"), Decimal("0.5")) == Decimal("0.000000002")
    assert batch_price(Decimal("7"), Decimal(1)) == 0 and batch_price(Decimal("7"), Decimal(0)) == 7
    rates = Rates(Decimal("0.15"), Decimal("0.075"), Decimal("0.6"), "usd", Decimal("0.5"))
    # 800k x 0.075 + 200k x 0.0375 + 500k x 0.3, per million
    assert rates.cost(1_000_000, 200_000, 500_000, batch=True) == Decimal("0.2175")
    assert rates.cost(1_000_000, 200_000, 500_000) == Decimal("0.435")
    assert rates.worst_case(1000, 100, batch=True) * 2 == rates.worst_case(1000, 100)
    assert Rates().cost(10**6, 0, 10**6, batch=True) == 0


async def test_batch_usage_has_its_own_lines_at_the_discount(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    """Org A used each model online and in batches: the batch tokens are lines of their own
    at the discounted unit price (half by default, a quarter off where the price says so),
    each rounded half-even to the cent once, beside unchanged online lines."""
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "0.15", "0.075", "0.6")  # batch: half off by default
    await add_model_price(sm, w.big, JAN, "2", "1", "8", batch_discount="0.25")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(3, 4), 1_000_000, 200_000, 500_000),
            # Two batches in two hours and a day apart: one line per meter, rounded once.
            w.usage(w.org_a, w.small_dep, t(3, 4), 600_000, 300_000, 100_000, batch_id="batch_1"),
            w.usage(w.org_a, w.small_dep, t(4, 9), 400_000, 100_000, 50_000, batch_id="batch_2"),
            w.usage(w.org_a, w.big_dep, t(5, 1), 50_000, 20_000, 27_500, batch_id="batch_3"),
            w.usage(w.org_a, w.big_dep, t(5, 1), 1_000_000, 0, 0),
            # Org B's batch on the dedicated deployment: paid by GPU time, never per token.
            w.usage(w.org_b, w.dedicated, t(6), 10**6, 0, 10**6, batch_id="batch_4"),
        ],
    )
    await _close(sm)
    invoice = (await _invoices(sm))[w.org_a]
    got = [(x.meter, x.model, x.quantity, x.unit_price, x.amount) for x in invoice.lines]
    assert got == [
        ("input", "big-model", Decimal(1_000_000), Decimal(2), Decimal("2.00")),
        # 30,000 x 1.50 = 0.045 -> 0.04 (half-even; half-up would say 0.05)
        ("batch_input", "big-model", Decimal(30_000), Decimal("1.5"), Decimal("0.04")),
        # 20,000 x 0.75 = 0.015 -> 0.02
        ("batch_cached_input", "big-model", Decimal(20_000), Decimal("0.75"), Decimal("0.02")),
        # 27,500 x 6 = 0.165 -> 0.16 (half-even; half-up would say 0.17)
        ("batch_output", "big-model", Decimal(27_500), Decimal(6), Decimal("0.16")),
        # Online: 800k x 0.15 = 0.12; 200k x 0.075 = 0.015 -> 0.02; 500k x 0.6 = 0.30
        ("input", "small-model", Decimal(800_000), Decimal("0.15"), Decimal("0.12")),
        ("cached_input", "small-model", Decimal(200_000), Decimal("0.075"), Decimal("0.02")),
        ("output", "small-model", Decimal(500_000), Decimal("0.6"), Decimal("0.30")),
        # Batch, exactly half, both batches on one line: 600k x 0.075 = 0.045 -> 0.04;
        # 400k x 0.0375 = 0.015 -> 0.02; 150k x 0.30 = 0.045 -> 0.04
        ("batch_input", "small-model", Decimal(600_000), Decimal("0.075"), Decimal("0.04")),
        ("batch_cached_input", "small-model", Decimal(400_000), Decimal("0.0375"), Decimal("0.02")),
        ("batch_output", "small-model", Decimal(150_000), Decimal("0.3"), Decimal("0.04")),
    ]
    assert invoice.total == invoice.subtotal == Decimal("2.76")
    assert [x.description for x in invoice.lines if x.model == "small-model"][3:] == [
        "small-model: batch input tokens at 0.075 USD per 1M tokens",
        "small-model: batch cached input tokens at 0.0375 USD per 1M tokens",
        "small-model: batch output tokens at 0.30 USD per 1M tokens",
    ]
    # The dedicated deployment has no GPU price here, and its tokens are free: no invoice.
    assert w.org_b not in await _invoices(sm)

    # The stored unit prices are exactly the computed ones: a rerun writes nothing.
    again = await rollup_hours(sm, JAN, FEB)
    assert (again.inserted, again.updated, again.deleted) == (0, 0, 0)
    # Budgets (spend_since) and the settled charge (Rates.cost) agree with the rollups.
    async with sm() as s:
        spent = await spend_since(s, w.org_a, JAN)
        small, big = await model_rates(s, w.small, t(3)), await model_rates(s, w.big, t(3))
        ledger = await s.scalars(select(UsageEvent).where(UsageEvent.org_id == w.org_a))
        charged = sum(
            (
                (small if e.deployment_id == w.small_dep else big).cost(
                    e.prompt_tokens, e.cached_tokens, e.completion_tokens, batch=e.batch_id is not None
                )
                for e in ledger
            ),
            Decimal(0),
        )
    assert spent == charged == Decimal("2.765")  # unrounded: 2.435 online + 0.33 batch
