"""The audit log: every admin change writes an entry in the same transaction (who, what,
when, before and after), no entry ever holds a secret, and it reads back filtered and
paginated, each organisation admin seeing their own organisation's only."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select

from control_plane.audit.models import AuditEntry
from control_plane.audit.services import snapshot
from control_plane.orgs.models import ApiKey, Organization, User
from tests.control_plane.conftest import GPU, MODEL, AdminEnv

API = "/admin/v1"


async def all_entries(
    env: AdminEnv, headers: dict[str, str] | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Every entry, following the pages (small ones, so paging is exercised)."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        params = {"limit": 3, **filters} | ({"after": after} if after is not None else {})
        r = await env.client.get(f"{API}/audit", headers=headers or env.root, params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        out += page["data"]
        if not page["has_more"]:
            return out
        after = page["last_id"]


async def root_key_id(env: AdminEnv) -> str:
    async with env.app.state.sessionmaker() as s:
        return str(await s.scalar(select(ApiKey.id).where(ApiKey.prefix == env.root_key[:11])))


async def test_a_journey_is_audited_without_secrets(
    admin_env: AdminEnv, good_adapter: dict[str, bytes]
) -> None:
    env, c, h = admin_env, admin_env.client, admin_env.root
    password = "correct horse battery staple"
    secrets: list[str] = [
        password,
        env.root_key,
        env.settings.secret_key or "",
        env.settings.internal_token or "",
    ]

    plan = (await c.post(f"{API}/plans", headers=h, json={"name": "gold", "requests_per_minute": 100})).json()
    org = (await c.post(f"{API}/organizations", headers=h, json={"name": "acme"})).json()
    await c.patch(f"{API}/organizations/{org['id']}", headers=h, json={"plan_id": plan["id"]})
    await c.patch(f"{API}/plans/{plan['id']}", headers=h, json={"requests_per_minute": 200})
    user = (
        await c.post(
            f"{API}/organizations/{org['id']}/users",
            headers=h,
            json={"email": "ada@acme.io", "password": password},
        )
    ).json()
    await c.patch(f"{API}/users/{user['id']}", headers=h, json={"password": password + "!"})
    secrets.append(password + "!")
    key = (
        await c.post(
            f"{API}/organizations/{org['id']}/keys", headers=h, json={"name": "ci", "user_id": user["id"]}
        )
    ).json()
    await c.patch(f"{API}/keys/{key['id']}", headers=h, json={"max_concurrent": 3})
    rotated = (await c.post(f"{API}/keys/{key['id']}/rotate", headers=h)).json()
    await c.delete(f"{API}/keys/{rotated['id']}", headers=h)
    secrets += [key["secret"], rotated["secret"]]
    model = (await c.post(f"{API}/models", headers=h, json={"name": "m2", "source": "/models/m2"})).json()
    await c.patch(f"{API}/models/{model['id']}", headers=h, json={"context_length": 1024})
    await c.delete(f"{API}/models/{model['id']}", headers=h)
    adapter = (await env.upload(org["id"], h, good_adapter)).json()
    dep = (
        await c.post(
            f"{API}/deployments",
            headers=h,
            json={
                "name": "acme-dep",
                "model": MODEL,
                "gpu_type": GPU,
                "org_id": org["id"],
                "adapters": [adapter["id"]],
            },
        )
    ).json()
    await c.patch(f"{API}/deployments/{dep['id']}", headers=h, json={"adapters": [], "status": "stopped"})
    await c.delete(f"{API}/deployments/{dep['id']}", headers=h)
    await c.delete(f"{API}/adapters/{adapter['id']}", headers=h)
    await c.post(f"{API}/organizations/{org['id']}/suspend", headers=h)
    await c.post(f"{API}/organizations/{org['id']}/resume", headers=h)
    await c.patch(f"{API}/users/{user['id']}", headers=h, json={"disabled": True})

    entries = await all_entries(env, since=(datetime.now(UTC) - timedelta(minutes=5)).isoformat())
    done = [(e["action"], e["resource_type"], e["resource_id"]) for e in reversed(entries)]
    expected = [
        ("create", "plan", plan["id"]),
        ("create", "organization", org["id"]),
        ("update", "organization", org["id"]),
        ("update", "plan", plan["id"]),
        ("create", "user", user["id"]),
        ("update", "user", user["id"]),
        ("create", "api_key", key["id"]),
        ("update", "api_key", key["id"]),
        ("create", "api_key", rotated["id"]),
        ("rotate", "api_key", key["id"]),
        ("revoke", "api_key", rotated["id"]),
        ("create", "model", model["id"]),
        ("update", "model", model["id"]),
        ("delete", "model", model["id"]),
        ("create", "adapter", adapter["id"]),
        ("create", "deployment", dep["id"]),
        ("update", "deployment", dep["id"]),
        ("delete", "deployment", dep["id"]),
        ("delete", "adapter", adapter["id"]),
        ("suspend", "organization", org["id"]),
        ("resume", "organization", org["id"]),
        ("update", "user", user["id"]),
    ]
    # the bootstrap's entries (first start) come before; everything since is exactly this
    assert done[-len(expected) :] == expected
    by = {(e["action"], e["resource_type"], e["resource_id"]): e for e in reversed(entries)}  # newest wins
    root_id = await root_key_id(env)
    assert {e["actor_key_id"] for e in entries[: len(expected)]} == {root_id}
    # before and after say what changed
    plan_update = by[("update", "plan", plan["id"])]
    assert (plan_update["before"]["requests_per_minute"], plan_update["after"]["requests_per_minute"]) == (
        100,
        200,
    )
    assigned = by[("update", "organization", org["id"])]
    assert (assigned["before"]["plan_id"], assigned["after"]["plan_id"]) == (None, plan["id"])
    assert by[("rotate", "api_key", key["id"])]["after"]["replaced_by"] == rotated["id"]
    assert by[("delete", "model", model["id"])]["after"] is None
    assert by[("delete", "model", model["id"])]["before"]["name"] == "m2"
    assert by[("create", "adapter", adapter["id"])]["org_id"] == org["id"]
    assert by[("update", "user", user["id"])]["after"]["disabled"] is True
    password_change = next(
        e for e in entries if e["resource_id"] == user["id"] and "password_changed" in e["after"]
    )
    assert password_change["action"] == "update"  # that it changed is logged; the hash is not
    # ...and it was not a key of the organisation that created them, so no org admin sees plans
    assert by[("create", "plan", plan["id"])]["org_id"] is None

    # No secret, anywhere in the log: not the keys, not their hashes, not passwords or their
    # hashes, not the organisation's cache salt, not the server's secrets.
    async with env.app.state.sessionmaker() as s:
        secrets += [k.hash for k in await s.scalars(select(ApiKey))]
        secrets += [u.password_hash or "" for u in await s.scalars(select(User))]
        secrets += [o.cache_salt for o in await s.scalars(select(Organization))]
        rows = list(await s.scalars(select(AuditEntry)))
    raw = json.dumps([[r.before, r.after] for r in rows])
    assert len(rows) >= len(expected)
    leaked = [secret for secret in secrets if secret and secret in raw]
    assert leaked == [], "secrets in the audit log"
    for r in rows:
        for snap in (r.before, r.after):
            assert not {"hash", "password_hash", "cache_salt", "secret", "password"} & set(snap or {})


async def test_org_admins_read_their_own_organisation_only(admin_env: AdminEnv) -> None:
    a, b = await admin_env.org("org-a"), await admin_env.org("org-b")
    c = admin_env.client
    await c.post(f"{API}/organizations/{a.id}/keys", headers=a.headers, json={"name": "a1"})
    await c.post(f"{API}/organizations/{b.id}/keys", headers=b.headers, json={"name": "b1"})
    mine = await all_entries(admin_env, a.headers)
    assert mine and {e["org_id"] for e in mine} == {a.id}
    assert {e["resource_type"] for e in mine} == {"organization", "api_key"}
    assert (await c.get(f"{API}/audit", headers=a.headers, params={"org_id": b.id})).status_code == 404
    assert await all_entries(admin_env, a.headers, org_id=a.id) == mine
    # the platform admin sees both, and can narrow to one
    assert {e["org_id"] for e in await all_entries(admin_env)} >= {a.id, b.id}
    assert {e["org_id"] for e in await all_entries(admin_env, org_id=b.id)} == {b.id}


async def test_filters_and_pages(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    start = datetime.now(UTC)
    ids = [(await c.post(f"{API}/plans", headers=h, json={"name": f"p{i}"})).json()["id"] for i in range(5)]
    await c.patch(f"{API}/plans/{ids[0]}", headers=h, json={"max_concurrent": 9})
    plans = await all_entries(admin_env, resource_type="plan")
    assert [e["resource_id"] for e in plans] == [ids[0], *reversed(ids)]  # newest first
    assert len({e["id"] for e in plans}) == len(plans)  # no entry twice across pages
    assert [e["action"] for e in await all_entries(admin_env, resource_id=ids[0])] == ["update", "create"]
    assert len(await all_entries(admin_env, action="create", resource_type="plan")) == 5
    assert await all_entries(admin_env, until=start.isoformat(), resource_type="plan") == []
    assert await all_entries(admin_env, since=(datetime.now(UTC) + timedelta(hours=1)).isoformat()) == []
    # the system's own changes (first start: the default organisation and its admin key) have no actor
    boot = await all_entries(admin_env, org_id=admin_env.default_org, resource_type="api_key")
    assert boot[-1]["action"] == "create" and boot[-1]["actor_key_id"] is None
    page = (await c.get(f"{API}/audit", headers=h, params={"limit": 2})).json()
    assert len(page["data"]) == 2 and page["has_more"] and page["object"] == "list"


async def test_bad_queries_are_400_and_failed_changes_leave_no_entry(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    for params, param in [
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"since": "yesterday"}, "since"),
    ]:
        r = await c.get(f"{API}/audit", headers=h, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    before = len(await all_entries(admin_env))
    assert (await c.post(f"{API}/organizations", headers=h, json={"name": "default"})).status_code == 409
    assert (await c.post(f"{API}/plans", headers=h, json={"name": "p", "token_burst": 1})).status_code == 400
    assert len(await all_entries(admin_env)) == before


def test_snapshots_leave_out_secret_columns_by_name() -> None:
    """Whatever table a snapshot is of (billing's too), secret-looking columns stay out."""
    key = ApiKey(id="key_1", org_id="org_1", prefix="tm-abcdefgh", hash="deadbeef", name="n", role="member")
    snap = snapshot(key)
    assert snap["prefix"] == "tm-abcdefgh" and "hash" not in snap
    org = Organization(id="org_1", name="acme", cache_salt="salty", status="active", billing_mode="none")
    assert "cache_salt" not in snapshot(org) and snapshot(org)["name"] == "acme"
    user = User(id="user_1", email="a@b.io", password_hash="$argon2id$...", role="member", disabled=False)
    assert "password_hash" not in snapshot(user)
