from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.bootstrap import bootstrap
from control_plane.catalog.lifetimes import WorkerLifetimes
from control_plane.catalog.models import Worker
from control_plane.catalog.services import CatalogService
from control_plane.orgs.keys import ApiKeyService, authenticate
from control_plane.orgs.models import ApiKey
from control_plane.orgs.services import OrganizationService
from control_plane.policy import Principal
from tokenmill.db import utcnow
from tokenmill.errors import APIError
from tokenmill.protocol import Heartbeat, WorkerAnnounce, WorkerDeparture

SECRET = "test-secret-key"


async def _org_and_key(sm: async_sessionmaker[AsyncSession], **kw: object) -> tuple[str, str]:
    async with sm() as s, s.begin():
        org = await OrganizationService(session=s).create_org("acme")
        created = await ApiKeyService(session=s).create_key(org_id=org.id, secret_key=SECRET, **kw)  # type: ignore[arg-type]
        return org.id, created.secret


async def test_key_is_stored_only_as_hash(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    _, secret = await _org_and_key(migrated_db, name="ci")
    assert secret.startswith("tm-")
    async with migrated_db() as s:
        row = (await s.execute(select(ApiKey))).scalar_one()
        assert secret not in (row.hash, row.prefix) and secret.startswith(row.prefix)
        key, org = await authenticate(s, secret, SECRET)
        assert key.id == row.id and org.name == "acme"


@pytest.mark.parametrize(
    "mangle", [lambda k: k[:-1] + ("A" if k[-1] != "A" else "B"), lambda k: k[:-3], str.upper]
)
async def test_wrong_keys_are_401(migrated_db: async_sessionmaker[AsyncSession], mangle) -> None:  # type: ignore[no-untyped-def]
    _, secret = await _org_and_key(migrated_db)
    async with migrated_db() as s:
        with pytest.raises(APIError) as err:
            await authenticate(s, mangle(secret), SECRET)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"


async def test_hash_depends_on_server_secret(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    _, secret = await _org_and_key(migrated_db)
    async with migrated_db() as s:
        with pytest.raises(APIError):
            await authenticate(s, secret, "another-server-secret")


async def test_revoked_and_expired_keys_are_refused(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    org_id, secret = await _org_and_key(migrated_db)
    async with migrated_db() as s, s.begin():
        keys = ApiKeyService(session=s)
        soon = await keys.create_key(
            org_id=org_id, secret_key=SECRET, expires_at=utcnow() + timedelta(seconds=1)
        )
        assert len(await keys.list_for_org(org_id)) == 2
        revoked = await keys.revoke(secret[:11])
        assert revoked.revoked_at is not None
    async with migrated_db() as s:
        with pytest.raises(APIError, match="revoked"):
            await authenticate(s, secret, SECRET)
        await authenticate(s, soon.secret, SECRET)  # still valid
    await asyncio.sleep(1.1)
    async with migrated_db() as s:
        with pytest.raises(APIError, match="expired"):
            await authenticate(s, soon.secret, SECRET)


async def test_revoke_is_confined_to_the_tenant(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    _, secret = await _org_and_key(migrated_db)
    async with migrated_db() as s, s.begin():
        other = await OrganizationService(session=s).create_org("globex")
        with pytest.raises(APIError) as err:
            await ApiKeyService(session=s).revoke(secret[:11], actor=Principal("org_admin", other.id))
    assert err.value.status == 404


async def test_bad_input_is_refused(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    async with migrated_db() as s, s.begin():
        orgs = OrganizationService(session=s)
        org = await orgs.create_org("acme")
        with pytest.raises(APIError) as dup:
            await orgs.create_org("acme")
        assert dup.value.status == 409
        with pytest.raises(APIError) as role:
            await ApiKeyService(session=s).create_key(org_id=org.id, secret_key=SECRET, role="god")
        assert role.value.status == 400 and role.value.param == "role"


async def test_bootstrap_creates_admin_once(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    args = dict(
        secret_key=SECRET, model_name="m", model_source="bundled:x", model_format="hf", context_length=64
    )
    first = await bootstrap(migrated_db, **args)  # type: ignore[arg-type]
    second = await bootstrap(migrated_db, **args)  # type: ignore[arg-type]
    assert first.admin_secret and second.admin_secret is None
    assert first.deployment.id == second.deployment.id and first.org.id == second.org.id
    async with migrated_db() as s:
        key, _ = await authenticate(s, first.admin_secret, SECRET)
        assert key.role == "platform_admin"
        dep, model, _ = await CatalogService(s).resolve("m", first.org.id)
        assert dep.type == "serverless" and model.context_length == 64
        with pytest.raises(APIError) as err:
            await CatalogService(s).resolve("nope", first.org.id)
        assert err.value.status == 404 and err.value.code == "model_not_found"


async def test_worker_lifetimes_recorded(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    boot = await bootstrap(
        migrated_db, secret_key=SECRET, model_name="m", model_source="x", model_format="hf", context_length=64
    )
    dep = boot.deployment.id
    lifetimes = WorkerLifetimes(bus=None, sessionmaker=migrated_db, consumer="t")  # type: ignore[arg-type]
    t0 = time.time()
    await lifetimes.apply(
        [WorkerAnnounce(worker_id="w1", deployment_id=dep, address="http://a", model="m", ts=t0)]
    )
    await lifetimes.apply(
        [Heartbeat(worker_id="w1", deployment_id=dep, address="http://a", model="m", ts=t0 + 6)]
    )
    # a worker started by hand for an unknown deployment is still recorded
    await lifetimes.apply(
        [WorkerAnnounce(worker_id="w2", deployment_id="dep_x", address="http://b", model="m", ts=t0)]
    )
    await lifetimes.apply([WorkerDeparture(worker_id="w1", deployment_id=dep, ts=t0 + 10)])
    await lifetimes.apply(
        [WorkerDeparture(worker_id="w1", deployment_id=dep, ts=t0 + 99)]
    )  # replayed: no change
    async with migrated_db() as s:
        w1 = await s.get(Worker, "w1")
        w2 = await s.get(Worker, "w2")
    assert w1 is not None and w2 is not None
    assert w1.deployment_id == dep and w1.status == "stopped"
    assert (w1.stopped_at - w1.started_at).total_seconds() == pytest.approx(10, abs=0.01)
    assert w2.deployment_id is None and w2.stopped_at is None


async def test_a_lost_worker_s_lifetime_ends_at_its_last_heartbeat(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    """Killed (SIGKILL) without a goodbye: the reconciler's departure for it closes the row."""
    boot = await bootstrap(
        migrated_db, secret_key=SECRET, model_name="m", model_source="x", model_format="hf", context_length=64
    )
    dep = boot.deployment.id
    lifetimes = WorkerLifetimes(bus=None, sessionmaker=migrated_db, consumer="t")  # type: ignore[arg-type]
    t0 = time.time()
    await lifetimes.apply([WorkerAnnounce(worker_id="w1", deployment_id=dep, address="a", model="m", ts=t0)])
    # heartbeats each second; last_seen_at is only written every few seconds of them
    for i in range(1, 8):
        await lifetimes.apply(
            [Heartbeat(worker_id="w1", deployment_id=dep, address="a", model="m", ts=t0 + i)]
        )
    await lifetimes.apply([WorkerDeparture(worker_id="w1", deployment_id=dep, ts=t0 + 7, lost=True)])
    async with migrated_db() as s:
        w1 = await s.get(Worker, "w1")
    assert w1 is not None and w1.status == "lost"
    assert w1.stopped_at == w1.last_seen_at
    assert (w1.stopped_at - w1.started_at).total_seconds() == pytest.approx(7, abs=0.01)


async def test_a_worker_declared_lost_that_speaks_again_is_billed_to_its_own_goodbye(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    """Starved past the timeout (a busy host), not dead: the reconciler's guess is overridden
    by what the worker says later, so the time it held its GPUs is billed. A lost declaration
    never overrides a goodbye, and a replayed old event never reopens a lifetime."""
    boot = await bootstrap(
        migrated_db, secret_key=SECRET, model_name="m", model_source="x", model_format="hf", context_length=64
    )
    dep = boot.deployment.id
    lifetimes = WorkerLifetimes(bus=None, sessionmaker=migrated_db, consumer="t")  # type: ignore[arg-type]
    t0 = time.time()

    async def row(worker_id: str) -> tuple[str, float | None]:
        async with migrated_db() as s:
            w = await s.get(Worker, worker_id)
        assert w is not None
        return w.status, None if w.stopped_at is None else (w.stopped_at - w.started_at).total_seconds()

    def beat(worker_id: str, at: float) -> Heartbeat:
        return Heartbeat(worker_id=worker_id, deployment_id=dep, address="a", model="m", ts=t0 + at)

    for w in ("w1", "w2"):
        await lifetimes.apply([WorkerAnnounce(worker_id=w, deployment_id=dep, address="a", model="m", ts=t0)])
        await lifetimes.apply([WorkerDeparture(worker_id=w, deployment_id=dep, ts=t0 + 3, lost=True)])
        assert await row(w) == ("lost", pytest.approx(3, abs=0.01))
    # w1 drains, then says goodbye itself
    await lifetimes.apply([WorkerDeparture(worker_id="w1", deployment_id=dep, ts=t0 + 20)])
    assert await row("w1") == ("stopped", pytest.approx(20, abs=0.01))
    await lifetimes.apply([WorkerDeparture(worker_id="w1", deployment_id=dep, ts=t0 + 30, lost=True)])
    assert await row("w1") == ("stopped", pytest.approx(20, abs=0.01))
    # w2 beats again: running again; an old beat (before the declaration) would not have
    await lifetimes.apply([beat("w2", 2)])
    assert await row("w2") == ("lost", pytest.approx(3, abs=0.01))
    await lifetimes.apply([beat("w2", 9)])
    assert await row("w2") == ("running", None)
    await lifetimes.apply([WorkerDeparture(worker_id="w2", deployment_id=dep, ts=t0 + 12)])
    assert await row("w2") == ("stopped", pytest.approx(12, abs=0.01))
