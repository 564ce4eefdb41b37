"""Hourly rollups from the ledger and the workers' lifetimes, on SQLite and PostgreSQL:
priced at the price in effect when the usage happened, idempotent, exact."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.jobs import rollup_hours
from billing.models import UsageRollup
from billing.rollups.services import compute_rollups, spend_since
from tests.billing.billing_world import (
    FEB,
    JAN,
    World,
    add_gpu_price,
    add_model_price,
    add_usage,
    add_worker,
    make_world,
    t,
)


async def _rows(sm: async_sessionmaker[AsyncSession]) -> list[tuple[Any, ...]]:
    async with sm() as s:
        found = await s.scalars(
            select(UsageRollup).order_by(
                UsageRollup.hour,
                UsageRollup.org_id,
                UsageRollup.model,
                UsageRollup.meter,
                UsageRollup.price_id,
            )
        )
        return [
            (
                r.id,
                r.org_id,
                r.hour,
                r.deployment_id,
                r.model,
                r.adapter,
                r.meter,
                r.price_id,
                r.quantity,
                r.unit_price,
                r.amount,
                r.currency,
                r.computed_at,
            )
            for r in found
        ]


@pytest.fixture
async def world(migrated_db: async_sessionmaker[AsyncSession]) -> World:
    return await make_world(migrated_db)


async def test_tokens_by_hour_and_meter_at_the_price_then(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    v1 = await add_model_price(sm, w.small, JAN, "0.10", "0.05", "0.40")
    # A new price from 12:30: the same hour holds usage at both prices.
    v2 = await add_model_price(sm, w.small, t(15, 12, 30), "0.20", "0.10", "0.80")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(15, 12, 10), 1000, 200, 50),
            w.usage(w.org_a, w.small_dep, t(15, 12, 29, 59, 999999), 500, 0, 5),
            w.usage(w.org_a, w.small_dep, t(15, 12, 30), 300, 100, 7),
            w.usage(w.org_a, w.small_dep, t(15, 13, 0), 10, 0, 1, adapter=w.adapter),
            w.usage(w.org_b, w.small_dep, t(15, 12, 59), 40, 0, 0),
        ],
    )
    stats = await rollup_hours(sm, JAN, FEB)
    assert stats.inserted == len(await _rows(sm)) == stats.rows
    got = {(r[1], r[2], r[5], r[6], r[7]): (r[8], r[9], r[10]) for r in await _rows(sm)}
    h12, h13 = t(15, 12), t(15, 13)
    assert got == {
        (w.org_a, h12, "", "input", v1): (Decimal(1300), Decimal("0.1"), Decimal("0.00013")),
        (w.org_a, h12, "", "cached_input", v1): (Decimal(200), Decimal("0.05"), Decimal("0.00001")),
        (w.org_a, h12, "", "output", v1): (Decimal(55), Decimal("0.4"), Decimal("0.000022")),
        (w.org_a, h12, "", "input", v2): (Decimal(200), Decimal("0.2"), Decimal("0.00004")),
        (w.org_a, h12, "", "cached_input", v2): (Decimal(100), Decimal("0.1"), Decimal("0.00001")),
        (w.org_a, h12, "", "output", v2): (Decimal(7), Decimal("0.8"), Decimal("0.0000056")),
        (w.org_a, h13, w.adapter, "input", v2): (Decimal(10), Decimal("0.2"), Decimal("0.000002")),
        (w.org_a, h13, w.adapter, "output", v2): (Decimal(1), Decimal("0.8"), Decimal("0.0000008")),
        (w.org_b, h12, "", "input", v2): (Decimal(40), Decimal("0.2"), Decimal("0.000008")),
    }
    rows = await _rows(sm)
    assert {r[4] for r in rows} == {"small-model"}  # the catalogue name, not the requested one
    assert {r[3] for r in rows} == {w.small_dep}
    assert {r[11] for r in rows} == {"usd"}


async def test_rerunning_changes_nothing_and_recomputing_replaces(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "1", "0.5", "2")
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(3, h), 100 + h, 10, 20) for h in range(24)])
    first = await rollup_hours(sm, JAN, FEB)
    assert (first.inserted, first.updated, first.deleted) == (72, 0, 0)
    before = await _rows(sm)

    again = await rollup_hours(sm, JAN, FEB)
    assert (again.inserted, again.updated, again.deleted) == (0, 0, 0)
    assert await _rows(sm) == before  # same ids, same values, same computed_at
    # A sub-range (not on hour boundaries: widened to whole hours) also changes nothing.
    part = await rollup_hours(sm, t(3, 5, 30), t(3, 7, 1))
    assert (part.start, part.end, part.rows) == (t(3, 5), t(3, 8), 9)
    assert (part.inserted, part.updated, part.deleted) == (0, 0, 0)
    assert await _rows(sm) == before

    # A late event (the spool replayed it) changes its hour's rows only.
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(3, 4, 59), 1, 0, 1)])
    late = await rollup_hours(sm, JAN, FEB)
    assert (late.inserted, late.updated, late.deleted) == (0, 2, 0)
    # A back-dated price version re-rates from 10:00 on: those rows are replaced.
    new = await add_model_price(sm, w.small, t(3, 10), "3", "1", "4")
    rerated = await rollup_hours(sm, JAN, FEB)
    assert (rerated.inserted, rerated.updated, rerated.deleted) == (42, 0, 42)
    after = await _rows(sm)
    assert len(after) == 72
    assert {r[7] for r in after if r[2] >= t(3, 10)} == {new}
    assert sum(r[8] for r in after if r[6] == "input") == sum(100 + h - 10 for h in range(24)) + 1


async def test_dedicated_tokens_are_metered_not_charged(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.big, JAN, "5", "1", "10")
    await add_usage(sm, [w.usage(w.org_a, w.dedicated, t(2, 9), 1000, 0, 100)])
    await rollup_hours(sm, JAN, FEB)
    rows = await _rows(sm)
    assert [(r[3], r[6], r[7], r[8], r[9], r[10]) for r in rows] == [
        (w.dedicated, "input", "", Decimal(1000), Decimal(0), Decimal(0)),
        (w.dedicated, "output", "", Decimal(100), Decimal(0), Decimal(0)),
    ]


async def test_gpu_seconds_from_lifetimes_clipped_to_hours(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    p1 = await add_gpu_price(sm, "a100", JAN, "2.50")
    p2 = await add_gpu_price(sm, "a100", t(20, 0, 30), "3.00")  # mid-hour price change
    # Stopped: 10:15:30.25 to 13:05 = 10169.75 s over four hours.
    await add_worker(sm, "w1", w.dedicated, t(10, 10, 15, 30, 250000), stopped=t(10, 13, 5))
    # Lost (no stop): billed to its last heartbeat, across the price change.
    await add_worker(
        sm, "w2", w.dedicated, t(19, 23, 59, 59), last_seen=t(20, 1, 0, 0, 500000), status="lost"
    )
    # Across the month's end: only January's hour is January's.
    await add_worker(sm, "w3", w.dedicated, t(31, 23), stopped=t(32, 1))
    # Serverless workers are the platform's cost, and a worker of no deployment is no one's.
    await add_worker(sm, "w4", w.small_dep, t(5, 1), stopped=t(5, 2))
    await add_worker(sm, "w5", None, t(5, 1), stopped=t(5, 2))
    await rollup_hours(sm, JAN, FEB)
    got = {(r[2], r[7]): r[8] for r in await _rows(sm) if r[6] == "gpu_seconds"}
    assert got == {
        (t(10, 10), p1): Decimal("2669.75"),
        (t(10, 11), p1): Decimal(3600),
        (t(10, 12), p1): Decimal(3600),
        (t(10, 13), p1): Decimal(300),
        (t(19, 23), p1): Decimal(1),
        (t(20, 0), p1): Decimal(1800),
        (t(20, 0), p2): Decimal(1800),
        (t(20, 1), p2): Decimal("0.5"),
        (t(31, 23), p2): Decimal(3600),
    }
    rows = {(r[2], r[7]): r for r in await _rows(sm) if r[6] == "gpu_seconds"}
    # Amounts are kept to 1e-9 (invoices price the summed quantities, not these).
    assert rows[t(10, 10), p1][10] == Decimal("1.853993056")  # 2669.75 s x 2.50 / 3600
    assert {r[1] for r in rows.values()} == {w.org_a}
    assert {(r[3], r[4]) for r in rows.values()} == {(w.dedicated, "big-model")}
    # February's rollups take the rest of w3.
    await rollup_hours(sm, FEB, FEB + timedelta(hours=2))
    feb = [r for r in await _rows(sm) if r[2] >= FEB]
    assert [(r[2], r[8]) for r in feb] == [(FEB, Decimal(3600))]


async def test_spend_since_is_the_rollup_arithmetic(
    migrated_db: async_sessionmaker[AsyncSession], world: World
) -> None:
    w, sm = world, migrated_db
    await add_model_price(sm, w.small, JAN, "0.10", "0.05", "0.40")
    await add_model_price(sm, w.small, t(15), "0.20", "0.10", "0.80")
    await add_gpu_price(sm, "a100", JAN, "2.00")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(14, 23), 1000, 100, 10),
            w.usage(w.org_a, w.small_dep, t(15, 1), 1000, 100, 10),
            w.usage(w.org_a, w.dedicated, t(15, 2), 10**6, 0, 10**6),  # GPU time, not tokens
            w.usage(w.org_b, w.small_dep, t(15, 1), 10**6, 0, 0),
        ],
    )
    await add_worker(sm, "w1", w.dedicated, t(15, 2), stopped=t(15, 2, 30))
    async with sm() as s:
        spent = await spend_since(s, w.org_a, JAN)
        later = await spend_since(s, w.org_a, t(15))
    first = (Decimal(900) * Decimal("0.10") + 100 * Decimal("0.05") + 10 * Decimal("0.40")) / 10**6
    second = (Decimal(900) * Decimal("0.20") + 100 * Decimal("0.10") + 10 * Decimal("0.80")) / 10**6
    gpu = Decimal(1800) * 2 / 3600
    assert spent == first + second + gpu
    assert later == second + gpu


# SQLite has one writer at a time: the race only exists on PostgreSQL.
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_concurrent_runs_agree(migrated_db: async_sessionmaker[AsyncSession], world: World) -> None:
    w, sm = world, migrated_db
    assert sm.kw["bind"].dialect.name == "postgresql"
    await add_model_price(sm, w.small, JAN, "1", "1", "1")
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(d, h), 10, 0, 1) for d in (1, 2) for h in range(24)])
    results = await asyncio.gather(*(rollup_hours(sm, JAN, FEB) for _ in range(4)))
    assert sum(r.inserted for r in results) >= 96
    rows = await _rows(sm)
    assert len(rows) == 96
    assert sum(r[8] for r in rows) == 48 * 11


async def test_compute_does_not_write(migrated_db: async_sessionmaker[AsyncSession], world: World) -> None:
    w, sm = world, migrated_db
    await add_usage(sm, [w.usage(w.org_a, w.small_dep, t(1), 10, 0, 1)])
    async with sm() as s:
        computed = await compute_rollups(s, JAN, FEB)
    assert len(computed) == 2
    assert all(r.unit_price == 0 and r.cost == 0 for r in computed.values())  # no price: free
    assert await _rows(sm) == []
