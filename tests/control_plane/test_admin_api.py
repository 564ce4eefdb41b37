"""The admin API through HTTP on the real app: roles, tenant isolation, validation, and
that what gateways cache (keys, organisations, plans) changes there at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from control_plane.catalog.models import Worker
from control_plane.orgs.models import User
from tests.control_plane.conftest import GPU, MODEL, AdminEnv

API = "/admin/v1"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Changes reach gateways over the bus: well within a second."""
    for _ in range(100):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return dict(body)


async def models_status(env: AdminEnv, key: str) -> int:
    return (await env.client.get("/v1/models", headers=bearer(key))).status_code


# --- roles ---------------------------------------------------------------------------------


async def test_member_keys_and_strangers_cannot_use_the_admin_api(admin_env: AdminEnv) -> None:
    member = await admin_env.member_key(admin_env.default_org)
    error(await admin_env.client.get(f"{API}/organizations", headers=bearer(member["secret"])), 403)
    error(await admin_env.client.get(f"{API}/models"), 401)
    error(await admin_env.client.get(f"{API}/audit", headers=bearer("tm-" + "x" * 48)), 401)


async def test_org_admins_cannot_do_platform_things(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c, h = admin_env.client, a.headers
    for method, path, body in [
        ("POST", "/organizations", {"name": "x"}),
        ("POST", "/models", {"name": "m2", "source": "/models/m2"}),
        ("POST", "/plans", {"name": "gold"}),
        ("POST", f"/organizations/{a.id}/suspend", None),
        ("PATCH", f"/organizations/{a.id}", {"plan_id": None}),
        ("PATCH", f"/organizations/{a.id}", {"billing_mode": "invoices"}),
        ("POST", "/deployments", {"name": "shared2", "model": MODEL, "type": "serverless"}),
        ("POST", f"/organizations/{a.id}/keys", {"role": "platform_admin"}),
        (
            "POST",
            f"/organizations/{a.id}/users",
            {"email": "x@a.io", "password": "p" * 12, "role": "platform_admin"},
        ),
    ]:
        r = await c.request(method, API + path, headers=h, json=body)
        error(r, 403)
    # ...but they read the shared catalogue and rename their own organisation
    assert (await c.get(f"{API}/models", headers=h)).json()[0]["name"] == MODEL
    assert (await c.get(f"{API}/plans", headers=h)).status_code == 200
    r = await c.patch(f"{API}/organizations/{a.id}", headers=h, json={"name": "org-a2"})
    assert r.status_code == 200 and r.json()["name"] == "org-a2"


async def test_another_organisations_resources_are_404(admin_env: AdminEnv) -> None:
    """An org admin of A gets exactly what a missing id gets for every resource of B."""
    a, b = await admin_env.org("org-a"), await admin_env.org("org-b")
    c = admin_env.client
    user = (
        await c.post(
            f"{API}/organizations/{b.id}/users",
            headers=b.headers,
            json={"email": "bob@b.io", "password": "s" * 12},
        )
    ).json()
    key = (await c.post(f"{API}/organizations/{b.id}/keys", headers=b.headers, json={"name": "b-key"})).json()
    dep = (
        await c.post(
            f"{API}/deployments",
            headers=b.headers,
            json={"name": "b-dedicated", "model": MODEL, "gpu_type": GPU},
        )
    ).json()
    assert dep["org_id"] == b.id  # an org admin's dedicated deployment is its organisation's
    for method, path, body in [
        ("GET", f"/organizations/{b.id}", None),
        ("PATCH", f"/organizations/{b.id}", {"name": "mine"}),
        ("GET", f"/organizations/{b.id}/users", None),
        ("POST", f"/organizations/{b.id}/users", {"email": "eve@a.io", "password": "e" * 12}),
        ("GET", f"/users/{user['id']}", None),
        ("PATCH", f"/users/{user['id']}", {"disabled": True}),
        ("GET", f"/organizations/{b.id}/keys", None),
        ("POST", f"/organizations/{b.id}/keys", {}),
        ("GET", f"/keys/{key['id']}", None),
        ("GET", f"/keys/{key['prefix']}", None),
        ("PATCH", f"/keys/{key['id']}", {"name": "stolen"}),
        ("DELETE", f"/keys/{key['id']}", None),
        ("POST", f"/keys/{key['id']}/rotate", None),
        ("GET", f"/organizations/{b.id}/adapters", None),
        ("GET", f"/deployments/{dep['id']}", None),
        ("PATCH", f"/deployments/{dep['id']}", {"status": "stopped"}),
        ("DELETE", f"/deployments/{dep['id']}", None),
        ("GET", f"/deployments?org_id={b.id}", None),
        ("GET", f"/audit?org_id={b.id}", None),
    ]:
        r = await c.request(method, API + path, headers=a.headers, json=body)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    # B's things are untouched, and A's listings hold none of them
    assert (await c.get(f"{API}/keys/{key['id']}", headers=b.headers)).json()["revoked_at"] is None
    assert await models_status(admin_env, key["secret"]) == 200
    deps = (await c.get(f"{API}/deployments", headers=a.headers)).json()
    assert [d["name"] for d in deps] == [MODEL]  # the shared one only
    assert [o["id"] for o in (await c.get(f"{API}/organizations", headers=a.headers)).json()] == [a.id]
    # the platform admin sees both
    assert {d["name"] for d in (await c.get(f"{API}/deployments", headers=admin_env.root)).json()} == {
        MODEL,
        "b-dedicated",
    }


# --- users ---------------------------------------------------------------------------------


async def test_users_lifecycle(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c, h = admin_env.client, a.headers
    r = await c.post(
        f"{API}/organizations/{a.id}/users",
        headers=h,
        json={"email": " Ada@Example.COM ", "password": "correct horse battery", "role": "org_admin"},
    )
    assert r.status_code == 201, r.text
    user = r.json()
    assert user["email"] == "ada@example.com" and user["role"] == "org_admin" and not user["disabled"]
    assert not {"password", "password_hash"} & set(user)
    async with admin_env.app.state.sessionmaker() as s:
        stored = await s.scalar(select(User.password_hash).where(User.id == user["id"]))
    assert stored and stored.startswith("$argon2") and "correct horse" not in stored
    # email unique, whatever its case
    dup = await c.post(
        f"{API}/organizations/{a.id}/users",
        headers=h,
        json={"email": "ADA@example.com", "password": "x" * 10},
    )
    error(dup, 409, "email")
    assert [u["id"] for u in (await c.get(f"{API}/organizations/{a.id}/users", headers=h)).json()] == [
        user["id"]
    ]
    assert (await c.get(f"{API}/users/{user['id']}", headers=h)).json()["email"] == "ada@example.com"
    error(await c.get(f"{API}/users/user_nope", headers=h), 404)


async def test_user_passwords_verify_for_the_dashboard_login(admin_env: AdminEnv) -> None:
    """What the dashboard's login (issue 8) will call: argon2 verification, disabled users refused."""
    from control_plane.orgs.services import UserService

    a = await admin_env.org("org-a")
    body = {"email": "ada@a.io", "password": "correct horse battery"}
    user = (
        await admin_env.client.post(f"{API}/organizations/{a.id}/users", headers=a.headers, json=body)
    ).json()
    async with admin_env.app.state.sessionmaker() as s:
        users = UserService(session=s)
        assert (await users.authenticate("ADA@a.io", "correct horse battery")).id == user["id"]  # type: ignore[union-attr]
        assert await users.authenticate("ada@a.io", "wrong horse battery") is None
        assert await users.authenticate("nobody@a.io", "correct horse battery") is None
    await admin_env.client.patch(f"{API}/users/{user['id']}", headers=a.headers, json={"disabled": True})
    async with admin_env.app.state.sessionmaker() as s:
        assert await UserService(session=s).authenticate("ada@a.io", "correct horse battery") is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"email": "not-an-email", "password": "long enough"}, "email"),
        ({"email": "a@b.io", "password": "short"}, "password"),
        ({"email": "a@b.io", "password": "long enough", "role": "god"}, "role"),
        ({"email": "a@b.io"}, "password"),
        ({"email": "a@b.io", "password": "long enough", "admin": True}, "admin"),
    ],
)
async def test_bad_users_are_400_naming_the_param(
    admin_env: AdminEnv, body: dict[str, Any], param: str
) -> None:
    r = await admin_env.client.post(
        f"{API}/organizations/{admin_env.default_org}/users", headers=admin_env.root, json=body
    )
    error(r, 400, param)


async def test_disabling_a_user_revokes_their_keys_everywhere(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c, h = admin_env.client, a.headers
    user = (
        await c.post(
            f"{API}/organizations/{a.id}/users", headers=h, json={"email": "u@a.io", "password": "p" * 10}
        )
    ).json()
    theirs = (
        await c.post(f"{API}/organizations/{a.id}/keys", headers=h, json={"user_id": user["id"]})
    ).json()
    other = (await c.post(f"{API}/organizations/{a.id}/keys", headers=h, json={})).json()
    assert theirs["user_id"] == user["id"]
    assert await models_status(admin_env, theirs["secret"]) == 200  # cached by the gateway now
    r = await c.patch(f"{API}/users/{user['id']}", headers=h, json={"disabled": True})
    assert r.status_code == 200 and r.json()["disabled"] is True

    async def refused() -> bool:
        return await models_status(admin_env, theirs["secret"]) == 401

    await eventually(refused, "the disabled user's key is refused")
    assert await models_status(admin_env, other["secret"]) == 200  # keys of no user are unaffected
    # a key for a disabled user, or for another organisation's user, is refused
    error(
        await c.post(f"{API}/organizations/{a.id}/keys", headers=h, json={"user_id": user["id"]}),
        400,
        "user_id",
    )
    b = await admin_env.org("org-b")
    error(
        await c.post(f"{API}/organizations/{b.id}/keys", headers=b.headers, json={"user_id": user["id"]}),
        400,
        "user_id",
    )
    r = await c.patch(f"{API}/users/{user['id']}", headers=h, json={"disabled": False, "role": "org_admin"})
    assert r.json()["disabled"] is False and r.json()["role"] == "org_admin"


# --- API keys ------------------------------------------------------------------------------


async def test_key_scopes_expiry_and_limits(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c, h = admin_env.client, a.headers
    expires = (datetime.now(UTC) + timedelta(days=30)).isoformat()
    body = {
        "name": "ci",
        "scopes": [MODEL],
        "expires_at": expires,
        "requests_per_minute": 60,
        "request_burst": 5,
        "tokens_per_minute": 10_000,
        "max_concurrent": 2,
    }
    r = await c.post(f"{API}/organizations/{a.id}/keys", headers=h, json=body)
    assert r.status_code == 201, r.text
    key = r.json()
    assert key["secret"].startswith("tm-") and key["prefix"] == key["secret"][:11]
    assert (key["scopes"], key["requests_per_minute"], key["request_burst"], key["max_concurrent"]) == (
        [MODEL],
        60,
        5,
        2,
    )
    # the gateway applies them
    caller = await admin_env.app.state.gateway.authenticate(f"Bearer {key['secret']}")
    assert caller.scopes == (MODEL,) and caller.quota.key_concurrent == 2
    assert (caller.quota.key_requests.per_minute, caller.quota.key_requests.burst) == (60, 5)
    # GET never shows the secret
    got = (await c.get(f"{API}/keys/{key['id']}", headers=h)).json()
    assert "secret" not in got and got["name"] == "ci"
    # PATCH changes them, and the gateway drops its cached record at once
    r = await c.patch(
        f"{API}/keys/{key['id']}", headers=h, json={"request_burst": None, "requests_per_minute": 600}
    )
    assert r.status_code == 200 and (r.json()["requests_per_minute"], r.json()["request_burst"]) == (
        600,
        None,
    )

    async def updated() -> bool:
        quota = (await admin_env.app.state.gateway.authenticate(f"Bearer {key['secret']}")).quota
        return quota.key_requests.per_minute == 600

    await eventually(updated, "the gateway sees the new limit")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"request_burst": 5}, "request_burst"),  # a burst without its rate
        ({"token_burst": 5, "requests_per_minute": 5}, "token_burst"),
        ({"requests_per_minute": 0}, "requests_per_minute"),
        ({"max_concurrent": -1}, "max_concurrent"),
        ({"tokens_per_minute": 2**40}, "tokens_per_minute"),
        ({"scopes": []}, "scopes"),
        ({"scopes": [MODEL, MODEL]}, "scopes"),
        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"expires_at": "tomorrow"}, "expires_at"),
        ({"role": "owner"}, "role"),
        ({"rate_limit": 5}, "rate_limit"),
    ],
)
async def test_bad_keys_are_400_naming_the_param(
    admin_env: AdminEnv, body: dict[str, Any], param: str
) -> None:
    r = await admin_env.client.post(
        f"{API}/organizations/{admin_env.default_org}/keys", headers=admin_env.root, json=body
    )
    error(r, 400, param)


async def test_rotate_gives_a_new_secret_and_revokes_the_old_everywhere(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c, h = admin_env.client, a.headers
    old = (
        await c.post(
            f"{API}/organizations/{a.id}/keys",
            headers=h,
            json={"name": "prod", "scopes": [MODEL], "tokens_per_minute": 1000, "token_burst": 100},
        )
    ).json()
    assert await models_status(admin_env, old["secret"]) == 200  # the gateway caches it
    r = await c.post(f"{API}/keys/{old['id']}/rotate", headers=h)
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["id"] != old["id"] and new["secret"] != old["secret"] and new["revoked_at"] is None
    same = ("org_id", "name", "role", "scopes", "tokens_per_minute", "token_burst", "expires_at", "user_id")
    assert {f: new[f] for f in same} == {f: old[f] for f in same}

    async def old_refused() -> bool:
        return await models_status(admin_env, old["secret"]) == 401

    await eventually(old_refused, "the rotated-out key is refused")
    assert await models_status(admin_env, new["secret"]) == 200
    assert (await c.get(f"{API}/keys/{old['id']}", headers=h)).json()["revoked_at"] is not None
    error(await c.post(f"{API}/keys/{old['id']}/rotate", headers=h), 409)  # a revoked key stays revoked
    error(await c.patch(f"{API}/keys/{old['id']}", headers=h, json={"name": "x"}), 409)


async def test_org_admins_cannot_touch_platform_admin_keys(admin_env: AdminEnv) -> None:
    """Even in their own organisation (the default one holds the bootstrap key)."""
    default_admin = await admin_env.client.post(
        f"{API}/organizations/{admin_env.default_org}/keys",
        headers=admin_env.root,
        json={"role": "org_admin"},
    )
    h = bearer(default_admin.json()["secret"])
    root_id = (
        await admin_env.client.get(f"{API}/organizations/{admin_env.default_org}/keys", headers=h)
    ).json()[0]["id"]
    for method, path in [("DELETE", f"/keys/{root_id}"), ("POST", f"/keys/{root_id}/rotate")]:
        error(await admin_env.client.request(method, API + path, headers=h), 403)
    assert await models_status(admin_env, admin_env.root_key) == 200


# --- organisations and plans ---------------------------------------------------------------


async def test_suspend_and_resume_reach_the_gateway_at_once(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    key = (await admin_env.member_key(a.id))["secret"]
    assert await models_status(admin_env, key) == 200
    r = await admin_env.client.post(f"{API}/organizations/{a.id}/suspend", headers=admin_env.root)
    assert r.status_code == 200 and r.json()["status"] == "suspended"

    async def suspended() -> bool:
        r = await admin_env.client.get("/v1/models", headers=bearer(key))
        return r.status_code == 403 and r.json()["error"]["code"] == "organization_suspended"

    await eventually(suspended, "the suspended organisation's key is refused")
    r = await admin_env.client.post(f"{API}/organizations/{a.id}/resume", headers=admin_env.root)
    assert r.json()["status"] == "active"

    async def resumed() -> bool:
        return await models_status(admin_env, key) == 200

    await eventually(resumed, "the resumed organisation's key works")


async def test_plans_and_assigning_one(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    a = await admin_env.org("org-a")
    key = f"Bearer {(await admin_env.member_key(a.id))['secret']}"
    gw = admin_env.app.state.gateway
    assert (await gw.authenticate(key)).quota.budget is None  # cached with the default tier
    body = {
        "name": "gold",
        "requests_per_minute": 120,
        "request_burst": 10,
        "max_concurrent": 4,
        "monthly_budget": "250.50",
        "budget_mode": "hard",
    }
    r = await c.post(f"{API}/plans", headers=h, json=body)
    assert r.status_code == 201, r.text
    plan = r.json()
    assert plan["monthly_budget"] in ("250.50", "250.5000") and plan["budget_mode"] == "hard"
    error(await c.post(f"{API}/plans", headers=h, json={"name": "gold"}), 409, "name")
    r = await c.patch(f"{API}/organizations/{a.id}", headers=h, json={"plan_id": plan["id"]})
    assert r.status_code == 200 and r.json()["plan_id"] == plan["id"]

    async def on_plan() -> bool:
        quota = (await gw.authenticate(key)).quota
        return quota.hard_budget and quota.org_requests is not None and quota.org_requests.per_minute == 120

    await eventually(on_plan, "the gateway applies the assigned plan")
    # a plan's new limits reach every organisation on it
    r = await c.patch(
        f"{API}/plans/{plan['id']}", headers=h, json={"requests_per_minute": 30, "request_burst": None}
    )
    assert r.status_code == 200 and r.json()["request_burst"] is None

    async def new_limits() -> bool:
        rate = (await gw.authenticate(key)).quota.org_requests
        return rate is not None and (rate.per_minute, rate.burst) == (30, 30)

    await eventually(new_limits, "the gateway applies the plan's new limits")
    error(await c.delete(f"{API}/plans/{plan['id']}", headers=h), 409)  # in use
    await c.patch(f"{API}/organizations/{a.id}", headers=h, json={"plan_id": None})
    assert (await c.delete(f"{API}/plans/{plan['id']}", headers=h)).status_code == 204
    error(await c.get(f"{API}/plans/{plan['id']}", headers=h), 404)
    error(
        await c.patch(f"{API}/organizations/{a.id}", headers=h, json={"plan_id": "plan_nope"}), 400, "plan_id"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": ""}, "name"),
        ({"name": "p", "token_burst": 10}, "token_burst"),
        ({"name": "p", "budget_mode": "hard"}, "budget_mode"),
        ({"name": "p", "budget_mode": "strict", "monthly_budget": "1"}, "budget_mode"),
        ({"name": "p", "monthly_budget": "-1"}, "monthly_budget"),
        ({"name": "p", "monthly_budget": "0.00001"}, "monthly_budget"),
        ({"name": "p", "monthly_budget": "lots"}, "monthly_budget"),
        ({"name": "p", "max_concurrent": 0}, "max_concurrent"),
    ],
)
async def test_bad_plans_are_400_naming_the_param(
    admin_env: AdminEnv, body: dict[str, Any], param: str
) -> None:
    error(await admin_env.client.post(f"{API}/plans", headers=admin_env.root, json=body), 400, param)


# --- models and deployments ----------------------------------------------------------------


async def test_models(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    body = {"name": "llama-3-8b", "source": "/models/llama-3-8b", "format": "hf", "context_length": 8192}
    r = await c.post(f"{API}/models", headers=h, json=body)
    assert r.status_code == 201, r.text
    model = r.json()
    assert (model["kind"], model["context_length"]) == ("generate", 8192)
    error(await c.post(f"{API}/models", headers=h, json=body), 409, "name")
    r = await c.patch(f"{API}/models/{model['id']}", headers=h, json={"context_length": 4096})
    assert r.json()["context_length"] == 4096
    assert (await c.get(f"{API}/models/llama-3-8b", headers=h)).json()["id"] == model["id"]  # by name too
    # the bundled model serves deployments: it cannot go
    bundled = (await c.get(f"{API}/models/{MODEL}", headers=h)).json()
    error(await c.delete(f"{API}/models/{bundled['id']}", headers=h), 409)
    assert (await c.delete(f"{API}/models/{model['id']}", headers=h)).status_code == 204
    error(await c.get(f"{API}/models/{model['id']}", headers=h), 404)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": "m", "source": "/m", "format": "onnx"}, "format"),
        ({"name": "m", "source": "/m", "kind": "classify"}, "kind"),
        ({"name": "m", "source": "/m", "context_length": 0}, "context_length"),
        ({"name": "m", "source": "/m/model.safetensors", "format": "gguf"}, "source"),
        ({"name": "has space", "source": "/m"}, "name"),
        ({"name": "m", "source": ""}, "source"),
        ({"name": "m"}, "source"),
    ],
)
async def test_bad_models_are_400_naming_the_param(
    admin_env: AdminEnv, body: dict[str, Any], param: str
) -> None:
    error(await admin_env.client.post(f"{API}/models", headers=admin_env.root, json=body), 400, param)


async def test_dedicated_deployments(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c = admin_env.client
    key = (await admin_env.member_key(a.id))["secret"]
    body = {"name": "a-private", "model": MODEL, "gpu_type": GPU, "min_replicas": 0, "max_replicas": 3}
    r = await c.post(f"{API}/deployments", headers=a.headers, json=body)
    assert r.status_code == 201, r.text
    dep = r.json()
    assert (dep["type"], dep["org_id"], dep["status"], dep["adapters"]) == ("dedicated", a.id, "active", [])
    listed = (await c.get("/v1/models", headers=bearer(key))).json()["data"]
    assert "a-private" in [m["id"] for m in listed]  # the organisation can call it by name
    r = await c.patch(
        f"{API}/deployments/{dep['id']}", headers=a.headers, json={"status": "stopped", "max_replicas": 1}
    )
    assert (r.json()["status"], r.json()["max_replicas"]) == ("stopped", 1)
    error(
        await c.patch(f"{API}/deployments/{dep['id']}", headers=a.headers, json={"min_replicas": 2}),
        400,
        "min_replicas",
    )
    error(await c.post(f"{API}/deployments", headers=a.headers, json=body), 409, "name")
    # org admins cannot change the shared deployment they can read
    shared = next(
        d for d in (await c.get(f"{API}/deployments", headers=a.headers)).json() if d["name"] == MODEL
    )
    error(
        await c.patch(f"{API}/deployments/{shared['id']}", headers=a.headers, json={"status": "stopped"}), 403
    )
    # a deployment whose workers ran is billed on their lifetimes: stop it, do not delete it
    async with admin_env.app.state.sessionmaker() as s, s.begin():
        s.add(
            Worker(
                id="w-1",
                deployment_id=dep["id"],
                address="http://x",
                model=MODEL,
                started_at=datetime.now(UTC),
            )
        )
    error(await c.delete(f"{API}/deployments/{dep['id']}", headers=a.headers), 409)
    never_ran = (
        await c.post(
            f"{API}/deployments", headers=a.headers, json={"name": "a-2", "model": MODEL, "gpu_type": GPU}
        )
    ).json()
    assert (await c.delete(f"{API}/deployments/{never_ran['id']}", headers=a.headers)).status_code == 204


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": "d", "model": "no-such-model"}, "model"),
        ({"name": "d", "model": MODEL, "min_replicas": 3, "max_replicas": 2}, "min_replicas"),
        ({"name": "d", "model": MODEL, "max_replicas": 0}, "max_replicas"),
        ({"name": "d", "model": MODEL, "min_replicas": -1}, "min_replicas"),
        ({"name": "d", "model": MODEL, "status": "paused"}, "status"),
        ({"name": "d", "model": MODEL, "type": "spot"}, "type"),
        ({"name": "d", "model": MODEL, "gpu_type": "H100 SXM"}, "gpu_type"),
        ({"name": "d", "model": MODEL, "adapters": ["adapter_nope"]}, "adapters"),
        ({"name": "d", "model": MODEL}, "org_id"),  # a dedicated one with no owner
        ({"name": "d", "model": MODEL, "type": "serverless", "org_id": "x"}, "org_id"),
        ({"name": "d", "model": MODEL, "org_id": "org_nope"}, "org_id"),
    ],
)
async def test_bad_deployments_are_refused_naming_the_param(
    admin_env: AdminEnv, body: dict[str, Any], param: str
) -> None:
    if param != "org_id":  # a platform admin says whose dedicated deployment it is
        body = {"org_id": admin_env.default_org} | body
    r = await admin_env.client.post(f"{API}/deployments", headers=admin_env.root, json=body)
    assert r.status_code in (400, 404), r.text
    error(r, r.status_code, param)


async def test_autoscaling_settings_per_deployment(admin_env: AdminEnv) -> None:
    """The policy's arrival-rate settings are set per deployment; a zero target is a 400 (it
    would divide the load by zero), and so are rate settings without a target rate."""
    c, h = admin_env.client, admin_env.root
    scaling = {
        "target_concurrency": 4,
        "target_rate": 1.5,
        "drain_time_seconds": 30,
        "forecast": True,
        "forecast_lead_seconds": 45,
    }
    body = {"name": "smol-scaled", "model": MODEL, "type": "serverless", "autoscaling": scaling}
    r = await c.post(f"{API}/deployments", headers=h, json=body)
    assert r.status_code == 201, r.text
    dep = r.json()
    assert dep["autoscaling"] == scaling
    path = f"{API}/deployments/{dep['id']}"
    for bad, param in [
        ({"target_concurrency": 0}, "target_concurrency"),
        ({"target_concurrency": -2}, "target_concurrency"),
        ({"target_rate": 0}, "target_rate"),
        ({"drain_time_seconds": 0, "target_rate": 1}, "drain_time_seconds"),
        ({"forecast": True}, "forecast"),  # without a target rate: nothing to forecast
        ({"drain_time_seconds": 10}, "drain_time_seconds"),
    ]:
        error(await c.patch(path, headers=h, json={"autoscaling": bad}), 400, f"autoscaling.{param}")
    zero = body | {"name": "z", "autoscaling": {"target_concurrency": 0}}
    error(await c.post(f"{API}/deployments", headers=h, json=zero), 400, "autoscaling.target_concurrency")
    assert (await c.get(path, headers=h)).json()["autoscaling"] == scaling  # none of it was written
    r = await c.patch(path, headers=h, json={"autoscaling": {"target_concurrency": 2, "target_rate": 0.5}})
    assert r.status_code == 200 and r.json()["autoscaling"] == {"target_concurrency": 2, "target_rate": 0.5}


async def test_serverless_deployment_by_a_platform_admin(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    r = await c.post(
        f"{API}/deployments", headers=h, json={"name": "smol-shared-2", "model": MODEL, "type": "serverless"}
    )
    assert r.status_code == 201 and r.json()["org_id"] is None
    a = await admin_env.org("org-a")
    assert "smol-shared-2" in [
        d["name"] for d in (await c.get(f"{API}/deployments", headers=a.headers)).json()
    ]


async def test_openapi_document_describes_the_admin_api(admin_env: AdminEnv) -> None:
    doc = (await admin_env.client.get("/openapi.json")).json()
    paths = set(doc["paths"])
    assert {
        f"{API}/organizations/{{org_id}}/users",
        f"{API}/keys/{{key_id}}/rotate",
        f"{API}/organizations/{{org_id}}/adapters",
        f"{API}/deployments/{{deployment_id}}",
        f"{API}/plans/{{plan_id}}",
        f"{API}/audit",
    } <= paths


async def test_platform_admin_sets_the_billing_mode(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-billed")
    c = admin_env.client
    r = await c.patch(f"{API}/organizations/{a.id}", headers=admin_env.root, json={"billing_mode": "meters"})
    assert r.status_code == 200 and r.json()["billing_mode"] == "meters"
    r = await c.patch(f"{API}/organizations/{a.id}", headers=admin_env.root, json={"billing_mode": "both"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "billing_mode"
