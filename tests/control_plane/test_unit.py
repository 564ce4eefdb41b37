"""The unit of work (control_plane/unit.py) on a migrated database of either kind: what
services collect is delivered after the commit, never before it and never for a change that
rolled back; files stored for a change that did not commit are removed."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.events import FilesOrphaned, outbox
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey
from control_plane.orgs.services import OrganizationService
from control_plane.policy import SYSTEM
from control_plane.unit import UnitOfWork
from tokenmill.protocol import KEYS, KeysChanged
from tokenmill.storage import LocalStorage

SECRET = "test-secret"


class Recorder:
    """A publisher that keeps what it is given, or fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, object]] = []
        self.fail = fail

    async def publish(self, stream: str, event: object) -> str:
        if self.fail:
            raise ConnectionError("the bus is down")
        self.sent.append((stream, event))
        return "1-0"

    async def close(self) -> None:
        return None


async def _key(sm: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with sm() as s, s.begin():
        org = await OrganizationService(session=s).create_org("acme")
        created = await ApiKeyService(session=s).create_key(org_id=org.id, secret_key=SECRET)
        return org.id, created.key.prefix


async def test_announcements_follow_the_commit(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    org_id, prefix = await _key(migrated_db)
    bus = Recorder()
    async with UnitOfWork.open(migrated_db, publisher=bus) as unit:
        await unit.keys.revoke(prefix)
        await unit.orgs.suspend(org_id, SYSTEM)
        assert bus.sent == []  # nothing is said before it is true
    assert bus.sent == [(KEYS, KeysChanged(prefix=prefix)), (KEYS, KeysChanged(org_id=org_id))]
    async with migrated_db() as s:
        key = await ApiKeyService(session=s).get_one(ApiKey.prefix == prefix)
        assert key.revoked_at is not None


async def test_a_change_that_rolls_back_is_never_announced(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    _, prefix = await _key(migrated_db)
    bus = Recorder()
    with pytest.raises(RuntimeError):
        async with UnitOfWork.open(migrated_db, publisher=bus) as unit:
            await unit.keys.revoke(prefix)
            raise RuntimeError("the request failed after the revocation")
    assert bus.sent == []
    async with migrated_db() as s:
        assert (await ApiKeyService(session=s).get_one(ApiKey.prefix == prefix)).revoked_at is None


async def test_a_committed_change_stands_when_the_bus_is_down(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    _, prefix = await _key(migrated_db)
    async with UnitOfWork.open(migrated_db, publisher=Recorder(fail=True)) as unit:
        await unit.keys.revoke(prefix)
    assert unit.undelivered == [KeysChanged(prefix=prefix)]  # gateways re-read within 30 s
    async with migrated_db() as s:
        assert (await ApiKeyService(session=s).get_one(ApiKey.prefix == prefix)).revoked_at is not None


async def test_files_go_with_the_commit_or_the_rollback(
    migrated_db: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    storage = LocalStorage(tmp_path)
    for name in ("kept-then-deleted", "stored-then-rolled-back", "stored-and-kept"):
        storage.put(f"adapters/{name}/adapter_config.json", b"{}")
    async with UnitOfWork.open(migrated_db) as unit:
        outbox(unit.session).committed.append(FilesOrphaned(storage, "adapters/kept-then-deleted/"))
        outbox(unit.session).rolled_back.append(FilesOrphaned(storage, "adapters/stored-and-kept/"))
    with pytest.raises(RuntimeError):
        async with UnitOfWork.open(migrated_db) as unit:
            outbox(unit.session).rolled_back.append(
                FilesOrphaned(storage, "adapters/stored-then-rolled-back/")
            )
            raise RuntimeError("no commit")
    assert sorted(storage.list("adapters/")) == ["adapters/stored-and-kept/adapter_config.json"]
