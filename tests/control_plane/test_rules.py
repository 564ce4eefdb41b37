"""The rules of issue 16, through the admin API on the real app (SQLite and PostgreSQL): a
suspended organisation is refused but for its invoices and usage and its deployments are held
at zero; quotas on dedicated replicas and GPUs; a dedicated deployment's GPU type is priced;
deployment names are unique per organisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from autoscaler.leader import SoleLease
from autoscaler.reconciler import Reconciler
from billing.models import StripeSuspension
from billing.stripe.webhooks import handle_event
from control_plane.audit.models import AuditEntry
from control_plane.catalog.models import Deployment
from control_plane.orgs.models import Organization
from tests.autoscaler.test_reconciler import Recorder
from tests.control_plane.conftest import GPU, MODEL, AdminEnv, Org, make_admin_env
from tests.control_plane.test_admin_api import API, bearer, error, models_status
from tokenmill.bus import MemoryBus


async def _dedicated(env: AdminEnv, org: Org, name: str, **body: Any) -> dict[str, Any]:
    r = await env.client.post(
        f"{API}/deployments", headers=org.headers, json={"name": name, "model": MODEL, "gpu_type": GPU} | body
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


async def _suspend(env: AdminEnv, org: Org, action: str = "suspend") -> None:
    r = await env.client.post(f"{API}/organizations/{org.id}/{action}", headers=env.root)
    assert r.status_code == 200, r.text


# --- suspension ----------------------------------------------------------------------------


async def test_a_suspended_organisations_admins_only_read_invoices_and_usage(admin_env: AdminEnv) -> None:
    c = admin_env.client
    a = await admin_env.org("org-a")
    await _suspend(admin_env, a)
    for method, path, body in [
        ("GET", f"/organizations/{a.id}", None),
        ("GET", f"/organizations/{a.id}/keys", None),
        ("POST", f"/organizations/{a.id}/keys", {"name": "more"}),
        ("POST", "/deployments", {"name": "big", "model": MODEL, "gpu_type": GPU, "max_replicas": 1000}),
        ("GET", "/audit", None),
        ("GET", "/prices/gpus", None),
    ]:
        body_ = error(await c.request(method, API + path, headers=a.headers, json=body), 403)
        assert body_["code"] == "organization_suspended", (method, path)
    # what it owes, and what for: still readable
    assert (await c.get(f"{API}/invoices", headers=a.headers)).status_code == 200
    assert (await c.get(f"{API}/exports/usage", headers=a.headers)).status_code == 200
    missing = await c.get(f"{API}/invoices/inv_nope", headers=a.headers)
    assert missing.status_code == 404  # read as usual: the suspension is no reason to refuse
    # platform admins operate the platform, whatever their own organisation's status
    assert (await c.get(f"{API}/organizations/{a.id}", headers=admin_env.root)).status_code == 200
    await _suspend(admin_env, a, "resume")
    assert (await c.get(f"{API}/organizations/{a.id}/keys", headers=a.headers)).status_code == 200


async def test_suspension_holds_deployments_at_zero_and_resuming_restores_them(admin_env: AdminEnv) -> None:
    c = admin_env.client
    a = await admin_env.org("org-a")
    running = await _dedicated(admin_env, a, "a-run", min_replicas=2, max_replicas=3)
    stopped = await _dedicated(admin_env, a, "a-off", status="stopped")
    provider = Recorder()
    rec = Reconciler(
        MemoryBus(), admin_env.app.state.sessionmaker, provider, SoleLease(), interval=1, worker_timeout=3
    )
    await rec.tick()
    assert provider.counts[running["id"]] == 2 and stopped["id"] not in provider.counts

    await _suspend(admin_env, a)
    got = (await c.get(f"{API}/deployments/{running['id']}", headers=admin_env.root)).json()
    assert (got["status"], got["min_replicas"], got["max_replicas"]) == ("suspended", 2, 3)
    await rec.tick()
    assert provider.counts[running["id"]] == 0
    assert rec.decisions[running["id"]].desired == 0
    # nor can it be switched back on while the organisation is suspended
    r = await c.patch(f"{API}/deployments/{running['id']}", headers=admin_env.root, json={"status": "active"})
    assert error(r, 409, "status")["code"] == "organization_suspended"

    await _suspend(admin_env, a, "resume")
    deps = {d["name"]: d for d in (await c.get(f"{API}/deployments?org_id={a.id}", headers=a.headers)).json()}
    assert (deps["a-run"]["status"], deps["a-run"]["min_replicas"], deps["a-run"]["max_replicas"]) == (
        "active",
        2,
        3,
    )
    assert deps["a-off"]["status"] == "stopped"  # an admin's stop outlives the suspension
    await rec.tick()
    assert provider.counts[running["id"]] == 2
    actions = await admin_env.audit(resource_id=running["id"])
    assert [e["action"] for e in actions][:2] == ["resume", "suspend"]


async def test_a_failed_stripe_payment_suspends_through_the_organisation_service(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    dep = await _dedicated(admin_env, a, "a-run")
    key = (await admin_env.member_key(a.id))["secret"]
    sm = admin_env.app.state.sessionmaker
    async with sm() as s, s.begin():
        (await s.get(Organization, a.id)).stripe_customer_id = "cus_1"  # type: ignore[union-attr]
    bus = admin_env.app.state.bus
    event = {
        "id": "evt_1",
        "type": "invoice.payment_failed",
        "data": {"object": {"id": "in_1", "customer": "cus_1"}},
    }
    outcome = await handle_event(sm, event, publisher=bus)
    assert outcome.outcome == "payment of in_1 failed; organisation suspended"
    async with sm() as s:
        assert (await s.get(Deployment, dep["id"])).status == "suspended"  # type: ignore[union-attr]
        assert await s.get(StripeSuspension, a.id) is not None
        entries = (await s.scalars(select(AuditEntry).where(AuditEntry.resource_id == a.id))).all()
        assert [e.action for e in entries][-1] == "suspend" and entries[-1].actor_key_id is None
    assert await models_status(admin_env, key) == 403  # announced on the bus once committed


# --- quotas ---------------------------------------------------------------------------------


async def test_plan_quotas_on_dedicated_replicas_and_gpus(admin_env: AdminEnv) -> None:
    c, root = admin_env.client, admin_env.root
    a = await admin_env.org("org-a")
    plan = (
        await c.post(
            f"{API}/plans", headers=root, json={"name": "small", "max_dedicated_replicas": 4, "max_gpus": 3}
        )
    ).json()
    assert (plan["max_dedicated_replicas"], plan["max_gpus"]) == (4, 3)
    await c.patch(f"{API}/organizations/{a.id}", headers=root, json={"plan_id": plan["id"]})
    first = await _dedicated(admin_env, a, "a-1", max_replicas=2)
    # 2 + 2 replicas fit 4, but 4 GPUs do not fit 3
    r = await c.post(
        f"{API}/deployments",
        headers=a.headers,
        json={"name": "a-2", "model": MODEL, "gpu_type": GPU, "max_replicas": 2},
    )
    body = error(r, 403, "max_replicas")
    assert body["code"] == "quota_exceeded" and "max_gpus is 3" in body["message"]
    await c.patch(f"{API}/plans/{plan['id']}", headers=root, json={"max_gpus": None})  # the default: 16
    second = await _dedicated(admin_env, a, "a-2", max_replicas=2)
    r = await c.patch(f"{API}/deployments/{second['id']}", headers=a.headers, json={"max_replicas": 3})
    assert "max_dedicated_replicas is 4" in error(r, 403, "max_replicas")["message"]
    # a stopped deployment holds nothing; switching it back on counts again
    await c.patch(f"{API}/deployments/{first['id']}", headers=a.headers, json={"status": "stopped"})
    r = await c.patch(f"{API}/deployments/{second['id']}", headers=a.headers, json={"max_replicas": 4})
    assert r.status_code == 200, r.text
    r = await c.patch(f"{API}/deployments/{first['id']}", headers=a.headers, json={"status": "active"})
    assert error(r, 403, "max_replicas")["code"] == "quota_exceeded"
    # over a lowered quota, shrinking is still allowed
    await c.patch(f"{API}/plans/{plan['id']}", headers=root, json={"max_dedicated_replicas": 1})
    r = await c.patch(f"{API}/deployments/{second['id']}", headers=a.headers, json={"max_replicas": 2})
    assert r.status_code == 200, r.text


async def test_the_platform_default_quota_applies_without_a_plan(
    tmp_path: Path, model_cache: Path, sqlite_url: str
) -> None:
    async with make_admin_env(tmp_path, model_cache, sqlite_url, default_max_dedicated_replicas=2) as env:
        a = await env.org("org-a")
        await _dedicated(env, a, "a-1", max_replicas=2)
        r = await env.client.post(
            f"{API}/deployments", headers=a.headers, json={"name": "a-2", "model": MODEL, "gpu_type": GPU}
        )
        message = error(r, 403, "max_replicas")["message"]
        assert "the platform's default quota max_dedicated_replicas is 2" in message


# --- GPU types in the price book ----------------------------------------------------------------


async def test_a_dedicated_deployment_needs_a_priced_gpu_type(admin_env: AdminEnv) -> None:
    c, root = admin_env.client, admin_env.root
    a = await admin_env.org("org-a")
    for body, says in [
        ({"name": "d", "model": MODEL}, "needs a gpu_type"),
        ({"name": "d", "model": MODEL, "gpu_type": "H100"}, "'H100' has no price"),
    ]:
        assert (
            says
            in error(await c.post(f"{API}/deployments", headers=a.headers, json=body), 400, "gpu_type")[
                "message"
            ]
        )
    # a price that starts tomorrow is not one yet
    tomorrow = "2999-01-01T00:00:00Z"
    r = await c.post(
        f"{API}/prices/gpus",
        headers=root,
        json={"gpu_type": "H100", "per_hour": "4", "effective_from": tomorrow},
    )
    assert r.status_code == 201, r.text
    error(
        await c.post(
            f"{API}/deployments", headers=a.headers, json={"name": "d", "model": MODEL, "gpu_type": "H100"}
        ),
        400,
        "gpu_type",
    )
    r = await c.post(f"{API}/prices/gpus", headers=root, json={"gpu_type": "H100", "per_hour": "4"})
    assert r.status_code == 201, r.text
    dep = await _dedicated(admin_env, a, "d", gpu_type="H100")
    r = await c.patch(f"{API}/deployments/{dep['id']}", headers=a.headers, json={"gpu_type": "A100"})
    error(r, 400, "gpu_type")
    error(
        await c.patch(f"{API}/deployments/{dep['id']}", headers=a.headers, json={"gpu_type": None}),
        400,
        "gpu_type",
    )
    # serverless deployments are the platform's, billed by the token
    r = await c.post(
        f"{API}/deployments", headers=root, json={"name": "shared-2", "model": MODEL, "type": "serverless"}
    )
    assert r.status_code == 201, r.text


# --- names ----------------------------------------------------------------------------------


async def test_deployment_names_are_unique_per_organisation(admin_env: AdminEnv) -> None:
    c, root = admin_env.client, admin_env.root
    a, b = await admin_env.org("org-a"), await admin_env.org("org-b")
    await _dedicated(admin_env, a, "support-bot")
    # another organisation may use the name, and learns nothing of A's from it
    await _dedicated(admin_env, b, "support-bot")
    again = {"name": "support-bot", "model": MODEL, "gpu_type": GPU}
    error(await c.post(f"{API}/deployments", headers=a.headers, json=again), 409, "name")
    # a serverless model every organisation sees is no dedicated deployment's name ...
    shadow = {"name": MODEL, "model": MODEL, "gpu_type": GPU}
    assert (
        "serverless model"
        in error(await c.post(f"{API}/deployments", headers=a.headers, json=shadow), 409, "name")["message"]
    )
    # ... nor is a name an organisation uses a new serverless deployment's
    shared = {"name": "support-bot", "model": MODEL, "type": "serverless"}
    error(await c.post(f"{API}/deployments", headers=root, json=shared), 409, "name")
    # each organisation calls its own
    for org in (a, b):
        key = (await admin_env.member_key(org.id))["secret"]
        names = [m["id"] for m in (await c.get("/v1/models", headers=bearer(key))).json()["data"]]
        assert names.count("support-bot") == 1


async def test_the_database_keeps_names_unique_per_organisation_and_among_serverless(
    admin_env: AdminEnv,
) -> None:
    sm = admin_env.app.state.sessionmaker
    a = await admin_env.org("org-a")
    async with sm() as s:
        model_id = (await s.scalars(select(Deployment.model_id).where(Deployment.name == MODEL))).one()

    async def insert(name: str, org_id: str | None) -> None:
        async with sm() as s, s.begin():
            s.add(
                Deployment(
                    name=name, model_id=model_id, org_id=org_id, type="dedicated" if org_id else "serverless"
                )
            )

    await insert("x", a.id)
    await insert("x", admin_env.default_org)  # another organisation
    await insert("x", None)  # serverless, once
    for org_id in (a.id, None):
        with pytest.raises(IntegrityError):
            await insert("x", org_id)
