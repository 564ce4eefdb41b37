"""An organisation admin sees only their organisation's data, on every page (issue 8,
acceptance 2), on SQLite and on PostgreSQL.

Two organisations, alpha and bravo, each with an admin, a key, a LoRA adapter, a dedicated
deployment with a live worker, usage in the ledger, rollups and an invoice. Alpha's admin
opens every page and download of the dashboard: each shows alpha's things and not one of
bravo's ids, names, emails, key prefixes or request ids. Bravo's resources asked for by id
answer 404 (exactly like missing ones), changes aimed at them are refused and leave them as
they were, and what only platform admins may do is refused too.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from billing.common import month_bounds
from billing.invoices.services import build_invoice_drafts
from billing.ledger.services import record_usage
from billing.prices.services import PriceBook
from billing.rollups.services import store_rollups
from tests.control_plane.conftest import GPU, MODEL, AdminEnv, lora_files
from tests.dashboard.conftest import Session, add_user, sign_in
from tokenmill.protocol import WORKERS, Heartbeat, UsageRecord

API = "/admin/v1"


async def _tenant(env: AdminEnv, name: str, shared_dep: str) -> dict[str, Any]:
    """An organisation with everything a page can show, all named after it."""
    c, root = env.client, env.root
    org = (await c.post(f"{API}/organizations", headers=root, json={"name": name})).json()
    user = await add_user(env, org["id"], f"admin@{name}.test", "org_admin")
    member = await add_user(env, org["id"], f"member@{name}.test", "member")
    key = (
        await c.post(f"{API}/organizations/{org['id']}/keys", headers=root, json={"name": f"{name}-key"})
    ).json()
    files = [("file", (n, b, "application/octet-stream")) for n, b in lora_files().items()]
    r = await c.post(
        f"{API}/organizations/{org['id']}/adapters",
        headers=root,
        data={"name": f"{name}-lora", "model": MODEL},
        files=files,
    )
    assert r.status_code == 201, r.text
    adapter = r.json()
    body = {
        "name": f"{name}-dedicated",
        "model": MODEL,
        "org_id": org["id"],
        "gpu_type": GPU,
        "min_replicas": 0,
    }
    dep = (await c.post(f"{API}/deployments", headers=root, json=body)).json()
    # usage: on the shared model (priced, so rollups and an invoice follow) and the dedicated one
    start = month_bounds(datetime.now(UTC))[0].timestamp()
    now = time.time()
    records = [
        UsageRecord(
            request_id=f"req-{name}-{i}",
            org_id=org["id"],
            model=MODEL if i % 2 else dep["name"],
            api_key_id=key["id"],
            deployment_id=shared_dep if i % 2 else dep["id"],
            prompt_tokens=1000 + i,
            completion_tokens=100 + i,
            ts=max(start + 1, now - 60 + i),
        )
        for i in range(6)
    ]
    async with env.app.state.sessionmaker() as session, session.begin():
        await record_usage(session, records)
    # a live worker of the dedicated deployment
    await env.app.state.bus.publish(
        WORKERS,
        Heartbeat(
            worker_id=f"{name}-worker",
            deployment_id=dep["id"],
            address="http://127.0.0.1:9",
            model=MODEL,
            waiting=3,
            kv_usage=0.25,
            ts=now,
        ),
    )
    return {
        "org": org,
        "user": user,
        "member": member,
        "key": key,
        "adapter": adapter,
        "dep": dep,
        "requests": [r.request_id for r in records],
    }


def _markers(t: dict[str, Any]) -> list[str]:
    """Everything of a tenant that may not appear on another tenant's pages."""
    return [
        t["org"]["id"],
        t["org"]["name"],
        t["user"]["id"],
        t["user"]["email"],
        t["member"]["email"],
        t["key"]["id"],
        t["key"]["prefix"],
        t["key"]["name"],
        t["adapter"]["id"],
        t["adapter"]["name"],
        t["dep"]["id"],
        t["dep"]["name"],
        f"{t['org']['name']}-worker",
        *t["requests"],
        *t["invoices"],
    ]


async def _world(env: AdminEnv) -> tuple[dict[str, Any], dict[str, Any], str]:
    deps = (await env.client.get(f"{API}/deployments", headers=env.root)).json()
    shared = next(d["id"] for d in deps if d["type"] == "serverless")
    alpha = await _tenant(env, "alpha", shared)
    bravo = await _tenant(env, "bravo", shared)
    now = datetime.now(UTC)
    async with env.app.state.sessionmaker() as session, session.begin():
        await PriceBook(session).add_model_price(
            model_ref=MODEL,
            input_per_mtok=Decimal("100"),
            output_per_mtok=Decimal("200"),
            effective_from=now - timedelta(days=40),
        )
    async with env.app.state.sessionmaker() as session, session.begin():
        await store_rollups(session, month_bounds(now)[0], now + timedelta(hours=1))
        build = await build_invoice_drafts(session, now)
    invoices = (await env.client.get(f"{API}/invoices", headers=env.root)).json()
    for t in (alpha, bravo):
        t["invoices"] = [i["id"] for i in invoices if i["org_id"] == t["org"]["id"]]
        assert len(t["invoices"]) == 1, (build, invoices)
    return alpha, bravo, shared


async def _refused(s: Session, path: str, data: dict[str, str]) -> None:
    """A 404 (or, for what only platform admins do, 403) page, or back to a page whose
    message says why not."""
    r = await s.post(path, data)
    if r.status_code == 303:
        r = await s.client.get(r.headers["location"], follow_redirects=True)
        assert 'class="flash error"' in r.text, (path, r.text[:2000])
    else:
        assert r.status_code in (403, 404), (path, r.status_code)


async def _wait_for_worker(s: Session, dep_id: str, worker: str) -> None:
    for _ in range(100):
        if worker in (await s.get(f"/deployments/{dep_id}/workers")).text:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{worker} never showed on the deployment page")


async def test_an_org_admin_sees_only_their_organisation(admin_env: AdminEnv) -> None:
    env = admin_env
    alpha, bravo, shared = await _world(env)
    s = await sign_in(str(env.client.base_url), alpha["user"]["email"])
    await _wait_for_worker(s, alpha["dep"]["id"], "alpha-worker")
    a_org, inv = alpha["org"]["id"], alpha["invoices"][0]
    month = datetime.now(UTC).strftime("%Y-%m")
    day = datetime.now(UTC).date()
    span = f"from={(day - timedelta(days=1)).isoformat()}&to={day.isoformat()}"
    # every page and download, with the parameters that show the most
    pages = {
        "/": ["alpha-dedicated"],
        "/?range=30d": ["alpha-dedicated"],
        "/orgs": [alpha["user"]["email"], alpha["member"]["email"]],  # redirects to their own
        f"/orgs/{a_org}": [alpha["user"]["email"], "alpha"],
        "/keys": [alpha["key"]["prefix"], "alpha-key"],
        f"/keys?org={a_org}": [alpha["key"]["prefix"]],
        "/models": ["alpha-lora"],
        "/deployments": ["alpha-dedicated"],
        f"/deployments/{alpha['dep']['id']}": ["alpha-worker"],
        f"/deployments/{alpha['dep']['id']}/workers": ["alpha-worker"],
        f"/deployments/{shared}": [MODEL],
        "/usage": ['data-requests="'],
        f"/usage?{span}": ['data-requests="'],
        f"/usage?{span}&key={alpha['key']['id']}": ['data-requests="'],
        f"/usage?{span}&model=alpha-dedicated": ['data-requests="'],
        f"/usage.csv?{span}": alpha["requests"],
        "/invoices": [inv],
        f"/invoices?month={month}": [inv],
        f"/invoices/{inv}": [inv],
        f"/invoices/{inv}/download/csv": [inv],
        f"/invoices/{inv}/download/json": [inv],
        f"/invoices/{inv}/download/pdf": ["%PDF-"],  # its text: tests/dashboard/test_billing_pages.py
        "/prices": [MODEL],
        "/keys?range=7d": [alpha["key"]["prefix"]],
        f"/keys/{alpha['key']['id']}/created": [alpha["key"]["prefix"]],  # the secret was never here
        "/limits": ["Limits"],
        f"/limits?org={a_org}": ["Limits"],
        "/audit": ["Audit log"],
        # searches run inside the organisation: the other's name finds nothing of theirs
        "/keys?q=bravo": ["No keys match"],
        "/audit?q=bravo": ["Audit log"],
        "/models?q=bravo": ["Models"],
        "/deployments?q=bravo": ["Deployments"],
        "/invoices?q=bravo": ["Invoices"],
    }
    forbidden = _markers(bravo)
    for path, expected in pages.items():
        r = await s.get(path, follow_redirects=True)
        assert r.status_code == 200, (path, r.status_code, r.text[:500])
        for text in expected:
            assert text in r.text, f"{path} does not show {text!r}"
        # (a search's page repeats what was searched for, nothing else of bravo's)
        leaked = [m for m in forbidden if m in r.text and m not in path]
        assert leaked == [], f"{path} shows bravo's {leaked}"
    # the shared deployment's workers are the platform's business: a count, no ids
    assert "local-" not in (await s.get(f"/deployments/{shared}")).text

    # --- bravo's things by id: 404, exactly like missing ones -----------------------------
    b_org = bravo["org"]["id"]
    for path in [
        f"/orgs/{b_org}",
        f"/keys?org={b_org}",
        f"/models?org={b_org}",
        f"/usage?org={b_org}",
        f"/usage?key={bravo['key']['id']}",
        f"/usage.csv?org={b_org}",
        f"/invoices?org={b_org}",
        f"/invoices/{bravo['invoices'][0]}",
        f"/invoices/{bravo['invoices'][0]}/download/json",
        f"/invoices/{bravo['invoices'][0]}/download/pdf",
        f"/deployments/{bravo['dep']['id']}",
        f"/deployments/{bravo['dep']['id']}/workers",
        f"/limits?org={b_org}",
        f"/audit?org={b_org}",
        f"/keys/{bravo['key']['id']}/created",
    ]:
        r = await s.get(path)
        assert r.status_code == 404, (path, r.status_code)
        # (the message may repeat the id asked for, nothing else of bravo's)
        assert not [m for m in forbidden if m in r.text and m not in path], path

    # --- changes aimed at bravo: 404, or refused with a message; nothing changes ------------
    for path, data in [
        (f"/keys/{bravo['key']['id']}/revoke", {}),
        (f"/keys/{bravo['key']['prefix']}/rotate", {}),
        (f"/adapters/{bravo['adapter']['id']}/delete", {}),
        (f"/deployments/{bravo['dep']['id']}", {"max_replicas": "5"}),
        (f"/users/{bravo['user']['id']}", {"disabled": "true"}),
        (f"/orgs/{b_org}/users", {"email": "eve@alpha.test", "password": "e" * 12, "role": "org_admin"}),
        (f"/orgs/{b_org}/status", {"status": "suspended"}),
        (f"/orgs/{b_org}/plan", {"plan_id": ""}),
        ("/keys", {"org": b_org, "name": "sneaky"}),
        ("/deployments", {"org": b_org, "name": "sneaky-dep", "model": MODEL}),
        # what only platform admins may do
        ("/orgs", {"name": "sneaky-org"}),
        ("/prices/models", {"model": MODEL, "input_per_mtok": "0", "output_per_mtok": "0"}),
        ("/prices/gpus", {"gpu_type": "sneaky-gpu", "per_hour": "0"}),
        ("/plans", {"name": "sneaky-plan"}),
        ("/rollups", {}),
        ("/invoices/generate", {"month": month}),
        (f"/invoices/{inv}/finalize", {}),
        (f"/invoices/{bravo['invoices'][0]}/finalize", {}),
    ]:
        await _refused(s, path, data)
    root = env.root
    c = env.client
    b_key = (await c.get(f"{API}/keys/{bravo['key']['id']}", headers=root)).json()
    assert b_key["revoked_at"] is None
    assert len((await c.get(f"{API}/organizations/{b_org}/keys", headers=root)).json()) == 1
    assert (await c.get(f"{API}/adapters/{bravo['adapter']['id']}", headers=root)).status_code == 200
    assert (await c.get(f"{API}/deployments/{bravo['dep']['id']}", headers=root)).json()["max_replicas"] == 1
    assert (await c.get(f"{API}/users/{bravo['user']['id']}", headers=root)).json()["disabled"] is False
    assert len((await c.get(f"{API}/organizations/{b_org}/users", headers=root)).json()) == 2
    org = (await c.get(f"{API}/organizations/{b_org}", headers=root)).json()
    assert org["status"] == "active"
    names = {o["name"] for o in (await c.get(f"{API}/organizations", headers=root)).json()}
    assert "sneaky-org" not in names
    deps = {d["name"] for d in (await c.get(f"{API}/deployments", headers=root)).json()}
    assert "sneaky-dep" not in deps
    plans = {p["name"] for p in (await c.get(f"{API}/plans", headers=root)).json()}
    assert "sneaky-plan" not in plans
    gpus = {p["gpu_type"] for p in (await c.get(f"{API}/prices/gpus", headers=root)).json()}
    assert "sneaky-gpu" not in gpus
    assert {i["status"] for i in (await c.get(f"{API}/invoices", headers=root)).json()} == {"draft"}
    # the audit log agrees: every change on bravo was the setup's, by the root key
    audit = (await c.get(f"{API}/audit", headers=root, params={"org_id": b_org})).json()["data"]
    assert {e["actor_user_id"] for e in audit} == {None}
    await s.client.aclose()


async def test_the_platform_admin_sees_both(admin_env: AdminEnv) -> None:
    env = admin_env
    alpha, bravo, _ = await _world(env)
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    s = await sign_in(str(env.client.base_url), "root@platform.test")
    await _wait_for_worker(s, bravo["dep"]["id"], "bravo-worker")
    for path, expected in {
        "/orgs": ["alpha", "bravo"],
        "/deployments": ["alpha-dedicated", "bravo-dedicated"],
        "/invoices": [*alpha["invoices"], *bravo["invoices"]],
        "/usage.csv": [*alpha["requests"], *bravo["requests"]],
        f"/keys?org={bravo['org']['id']}": [bravo["key"]["prefix"]],
    }.items():
        r = await s.get(path)
        assert r.status_code == 200, path
        assert all(text in r.text for text in expected), path
    await s.client.aclose()
