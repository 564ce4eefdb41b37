"""The stored responses of `/v1/responses` (control_plane/responses), on SQLite and PostgreSQL:
kept per organisation, invisible to others and once expired, deleted, paged, and purged by
the periodic job both schedulers run (billing/schedule.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.schedule import JobContext, jobs
from control_plane.orgs.models import Organization
from control_plane.responses.models import StoredResponse
from control_plane.responses.services import ResponseStore, page_items
from tokenmill.errors import APIError
from tokenmill.settings import Settings

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def _items(n: int) -> list[dict[str, object]]:
    return [
        {
            "id": f"msg_{i}",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": str(i)}],
        }
        for i in range(n)
    ]


async def _orgs(db: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with db() as s, s.begin():
        s.add_all([Organization(id="org_a", name="a"), Organization(id="org_b", name="b")])
    return "org_a", "org_b"


async def _keep(
    db: async_sessionmaker[AsyncSession], response_id: str, org_id: str, *, at: datetime = NOW
) -> None:
    async with db() as s, s.begin():
        await ResponseStore(s).add(
            response_id=response_id,
            org_id=org_id,
            model="m",
            response={"id": response_id, "object": "response", "output": [{"type": "message"}]},
            input_items=_items(3),
            lifetime=30 * DAY,
            now=at,
        )


async def test_a_response_is_its_organisations_only_and_until_it_expires(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    a, b = await _orgs(migrated_db)
    await _keep(migrated_db, "resp_1", a)
    async with migrated_db() as s:
        store = ResponseStore(s)
        found = await store.get(a, "resp_1", now=NOW + DAY)
        assert found is not None and found.response["id"] == "resp_1" and found.input_items == _items(3)
        assert found.expires_at == NOW + 30 * DAY
        # Another organisation, a made-up id and an expired response all read as missing.
        assert await store.get(b, "resp_1", now=NOW + DAY) is None
        assert await store.get(a, "resp_2", now=NOW + DAY) is None
        assert await store.get(a, "resp_1", now=NOW + 30 * DAY) is None
    async with migrated_db() as s, s.begin():
        assert not await ResponseStore(s).delete(b, "resp_1", now=NOW)  # not b's to delete
        assert await ResponseStore(s).delete(a, "resp_1", now=NOW)
        assert not await ResponseStore(s).delete(a, "resp_1", now=NOW)  # gone already
    async with migrated_db() as s:
        assert await s.scalar(select(func.count()).select_from(StoredResponse)) == 0


async def test_deleting_an_organisation_deletes_its_responses(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    a, b = await _orgs(migrated_db)
    await _keep(migrated_db, "resp_a", a)
    await _keep(migrated_db, "resp_b", b)
    async with migrated_db() as s, s.begin():
        await s.delete(await s.get(Organization, a))
    async with migrated_db() as s:
        assert list(await s.scalars(select(StoredResponse.id))) == ["resp_b"]


async def test_the_purge_job_deletes_expired_responses_only(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    a, b = await _orgs(migrated_db)
    await _keep(migrated_db, "resp_old", a, at=NOW - 31 * DAY)
    await _keep(migrated_db, "resp_edge", b, at=NOW - 30 * DAY)  # expires exactly now
    await _keep(migrated_db, "resp_new", a, at=NOW - 29 * DAY)
    # The job as Celery beat and `tokenmill serve` both run it: the one schedule.
    (job,) = [j for j in jobs(Settings()) if j.name == "purge_responses"]
    assert job.expires  # a missed run is covered by the next one
    assert await job.run(JobContext(Settings(), migrated_db), NOW) == {"purged": 2}
    async with migrated_db() as s:
        assert list(await s.scalars(select(StoredResponse.id))) == ["resp_new"]
    assert await job.run(JobContext(Settings(), migrated_db), NOW) == {"purged": 0}  # idempotent


def test_input_items_are_paged_newest_first_by_default() -> None:
    items = _items(5)
    page = page_items(items, after=None, limit=2, order="desc")
    assert [i["id"] for i in page.items] == ["msg_4", "msg_3"] and page.has_more
    page = page_items(items, after="msg_3", limit=2, order="desc")
    assert [i["id"] for i in page.items] == ["msg_2", "msg_1"] and page.has_more
    page = page_items(items, after="msg_1", limit=2, order="desc")
    assert [i["id"] for i in page.items] == ["msg_0"] and not page.has_more
    page = page_items(items, after="msg_2", limit=20, order="asc")
    assert [i["id"] for i in page.items] == ["msg_3", "msg_4"] and not page.has_more
    with pytest.raises(APIError) as err:
        page_items(items, after="msg_9", limit=2, order="asc")
    assert err.value.status == 400 and err.value.param == "after"
