"""Refused requests in the database: counts added per organisation, key, reason and minute
(two flushes of a minute, or two gateways, add up), read per time bucket and by reason, and
exported (CSV and JSON, each tenant only its own); keys' last use never moving back. SQLite
and PostgreSQL."""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.exports.services import REFUSAL_COLUMNS
from billing.models import Refusal
from billing.refusals.services import add_refusals, refusals_by_reason, refusals_per_bucket
from control_plane.orgs.keys import ApiKeyService, record_key_use
from control_plane.orgs.models import ApiKey
from control_plane.orgs.services import OrganizationService
from tests import databases
from tests.billing.billing_world import FEB, JAN, Api, admin_api, t
from tokenmill.db import make_engine


async def _rows(sm: async_sessionmaker[AsyncSession]) -> dict[tuple[str, str, str, object], int]:
    async with sm() as s:
        found = await s.execute(
            select(Refusal.org_id, Refusal.api_key_id, Refusal.reason, Refusal.minute, Refusal.count)
        )
        return {(o, k, r, m): n for o, k, r, m, n in found}


async def test_counts_add_up_per_key_reason_and_minute(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    sm = migrated_db
    m1, m2 = t(3, 4, 5), t(3, 4, 6)
    async with sm() as s, s.begin():
        await add_refusals(
            s,
            {
                ("org_a", "key_1", "rate_limit_requests", m1): 40,
                ("org_a", "key_1", "budget", m1): 2,
                ("org_a", "key_2", "rate_limit_requests", m1): 1,
                ("org_b", "key_3", "not_found", m2): 5,
            },
        )
    # The next flush of the same minute, and another gateway's: added to the same rows.
    for more in (
        {("org_a", "key_1", "rate_limit_requests", m1): 9, ("org_a", "key_1", "rate_limit_requests", m2): 3},
        {("org_a", "key_1", "rate_limit_requests", m1): 1, ("org_b", "key_3", "not_found", m2): 0},
    ):
        async with sm() as s, s.begin():
            await add_refusals(s, more)
    assert await _rows(sm) == {
        ("org_a", "key_1", "rate_limit_requests", m1): 50,
        ("org_a", "key_1", "budget", m1): 2,
        ("org_a", "key_2", "rate_limit_requests", m1): 1,
        ("org_a", "key_1", "rate_limit_requests", m2): 3,
        ("org_b", "key_3", "not_found", m2): 5,
    }

    hours = [t(3, 3), t(3, 4), t(3, 5)]
    async with sm() as s:
        assert await refusals_per_bucket(s, hours, t(3, 6)) == [0, 61, 0]
        assert await refusals_per_bucket(s, hours, t(3, 6), org_id="org_a") == [0, 56, 0]
        assert await refusals_per_bucket(s, hours, t(3, 6), org_id="org_a", key_id="key_1") == [0, 55, 0]
        # Bucket edges: [lo, hi) by the minute's start.
        assert await refusals_per_bucket(s, [t(3, 4), m2], t(3, 5)) == [53, 8]
        assert await refusals_by_reason(s, JAN, FEB, org_id="org_a") == {
            "rate_limit_requests": 54,
            "budget": 2,
        }
        assert await refusals_by_reason(s, JAN, FEB) == {
            "rate_limit_requests": 54,
            "not_found": 5,
            "budget": 2,
        }
        assert await refusals_by_reason(s, FEB, FEB + timedelta(days=1)) == {}


async def test_many_rows_in_one_flush(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    """More rows than one INSERT takes (SQLite's bound-value limit) go in chunks."""
    counts = {("org_a", f"key_{i}", "auth", t(3, 4, i % 60)): i + 1 for i in range(2500)}
    async with migrated_db() as s, s.begin():
        await add_refusals(s, counts)
    async with migrated_db() as s, s.begin():
        await add_refusals(s, counts)
    rows = await _rows(migrated_db)
    assert len(rows) == 2500 and sum(rows.values()) == 2 * sum(counts.values())


async def test_last_use_never_moves_back(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    async with migrated_db() as s, s.begin():
        org = await OrganizationService(session=s).create_org("acme")
        svc = ApiKeyService(session=s)
        k1 = (await svc.create_key(org_id=org.id, secret_key="x")).key.id
        k2 = (await svc.create_key(org_id=org.id, secret_key="x")).key.id

    async def last_used() -> dict[str, object]:
        async with migrated_db() as s:
            rows = await s.execute(select(ApiKey.id, ApiKey.last_used_at))
            return dict(rows.all())

    assert await last_used() == {k1: None, k2: None}
    async with migrated_db() as s, s.begin():
        await record_key_use(s, {k1: t(3, 4, 5, 6)})
    async with migrated_db() as s, s.begin():
        # An older time (a slower gateway's) is ignored; a later one wins; unknown ids are no error.
        await record_key_use(s, {k1: t(3, 4), k2: t(2), "key_gone": t(5)})
    async with migrated_db() as s, s.begin():
        await record_key_use(s, {k2: t(2, 1)})
    assert await last_used() == {k1: t(3, 4, 5, 6), k2: t(2, 1)}


# --- export -----------------------------------------------------------------------------------


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    await asyncio.to_thread(databases.migrate, db_url)
    async with admin_api(db_url, tmp_path, make_engine(db_url)) as env:
        yield env


def _csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


async def test_refusals_export(api: Api) -> None:
    """`GET /admin/v1/exports/refusals`: a row per organisation, key, reason and minute of the
    range, in CSV and JSON; an organisation admin gets only their own organisation's."""
    w, c = api.world, api.client
    async with api.sm() as s, s.begin():
        await add_refusals(
            s,
            {
                (w.org_a, "key_a", "rate_limit_requests", t(3, 4, 5)): 120,
                (w.org_a, "key_a", "context_length", t(3, 4, 5)): 1,
                (w.org_b, "key_b", "budget", t(4)): 7,
                (w.org_a, "key_a", "auth", FEB): 1,  # outside the range
            },
        )
    span = {"from": "2025-01", "to": "2025-02"}
    r = await c.get("/admin/v1/exports/refusals", headers=api.h("platform"), params=span)
    assert r.status_code == 200, r.text
    assert r.headers["content-disposition"].startswith('attachment; filename="refusals-all-20250101')
    assert r.text.splitlines()[0].split(",") == list(REFUSAL_COLUMNS)
    assert [tuple(x.values()) for x in _csv(r.text)] == [
        ("2025-01-03T04:05:00Z", w.org_a, "key_a", "context_length", "1"),
        ("2025-01-03T04:05:00Z", w.org_a, "key_a", "rate_limit_requests", "120"),
        ("2025-01-04T00:00:00Z", w.org_b, "key_b", "budget", "7"),
    ]
    r = await c.get("/admin/v1/exports/refusals", headers=api.h("admin_b"), params=span | {"format": "json"})
    assert r.json() == [
        {
            "minute": "2025-01-04T00:00:00Z",
            "org_id": w.org_b,
            "api_key_id": "key_b",
            "reason": "budget",
            "count": 7,
        }
    ]
    r = await c.get("/admin/v1/exports/refusals", headers=api.h("admin_a"), params=span | {"org": "globex"})
    assert r.status_code == 404
    r = await c.get("/admin/v1/exports/nothing", headers=api.h("platform"))
    assert r.status_code == 404 and "refusals" in r.json()["error"]["message"]
