"""Roles on every admin endpoint (issue 5, acceptance 5): with a member key and with an
org-admin key of organisation A, every operation of /admin/v1 is tried against
organisation B's resources (keys, users, adapters, deployments, usage, rollups, invoices,
the audit log, the organisation itself). Members get 403 everywhere; org admins get 404 for
whatever is B's (exactly like a missing id), 403 for what only platform admins may do, and
where they may read (the shared catalogue, their own listings) not one of B's ids. B's
resources are untouched afterwards.

The table of operations is checked against the running app's OpenAPI document, so an
endpoint added without a row here fails `test_every_admin_operation_has_a_role_case`.
Bad input is a 4xx whose message says what is wrong (and `param` names the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from billing.models import Invoice
from tests.control_plane.conftest import GPU, MODEL, AdminEnv

API = "/admin/v1"


@dataclass(frozen=True)
class Op:
    """One admin operation tried by A's keys against B: `path` is formatted with B's ids."""

    method: str
    route: str  # the OpenAPI path, after /admin/v1
    path: str
    body: dict[str, Any] | None = None
    admin: int = 404  # what A's org admin gets (a member always gets 403)
    upload: bool = False  # a multipart adapter upload instead of a JSON body


SLOW_PRICE = {"model": MODEL, "input_per_mtok": "9", "output_per_mtok": "9"}

# resource -> every operation of it, as A's keys try them on B.
CASES: dict[str, list[Op]] = {
    "organizations": [
        Op("GET", "/organizations", "/organizations", admin=200),
        Op("POST", "/organizations", "/organizations", {"name": "sneaky"}, admin=403),
        Op("GET", "/organizations/{org_id}", "/organizations/{org}"),
        Op("PATCH", "/organizations/{org_id}", "/organizations/{org}", {"name": "mine-now"}),
        Op("POST", "/organizations/{org_id}/suspend", "/organizations/{org}/suspend", admin=403),
        Op("POST", "/organizations/{org_id}/resume", "/organizations/{org}/resume", admin=403),
        Op("GET", "/organizations/{org_id}/limits", "/organizations/{org}/limits"),
    ],
    "users": [
        Op("GET", "/organizations/{org_id}/users", "/organizations/{org}/users"),
        Op(
            "POST",
            "/organizations/{org_id}/users",
            "/organizations/{org}/users",
            {"email": "eve@b.io", "password": "e" * 12, "role": "org_admin"},
        ),
        Op("GET", "/users/{user_id}", "/users/{user}"),
        Op("PATCH", "/users/{user_id}", "/users/{user}", {"disabled": True}),
    ],
    "keys": [
        Op("GET", "/organizations/{org_id}/keys", "/organizations/{org}/keys"),
        Op("POST", "/organizations/{org_id}/keys", "/organizations/{org}/keys", {"role": "org_admin"}),
        Op("GET", "/keys/{key_id}", "/keys/{key}"),
        Op("GET", "/keys/{key_id}", "/keys/{key_prefix}"),  # by prefix too
        Op("PATCH", "/keys/{key_id}", "/keys/{key}", {"name": "stolen", "expires_at": None}),
        Op("DELETE", "/keys/{key_id}", "/keys/{key}"),
        Op("DELETE", "/keys/{key_id}", "/keys/{key_prefix}"),
        Op("POST", "/keys/{key_id}/rotate", "/keys/{key}/rotate"),
    ],
    "adapters": [
        Op("GET", "/organizations/{org_id}/adapters", "/organizations/{org}/adapters"),
        Op("POST", "/organizations/{org_id}/adapters", "/organizations/{org}/adapters", upload=True),
        Op("GET", "/adapters/{adapter_id}", "/adapters/{adapter}"),
        Op("DELETE", "/adapters/{adapter_id}", "/adapters/{adapter}"),
    ],
    "deployments": [
        Op("GET", "/deployments", "/deployments", admin=200),
        Op("GET", "/deployments", "/deployments?org_id={org}"),
        Op("POST", "/deployments", "/deployments", {"name": "planted", "model": MODEL, "org_id": "{org}"}),
        # pinning B's adapter to a deployment of A's own: "no such adapter", naming it
        Op(
            "POST",
            "/deployments",
            "/deployments",
            {"name": "a-dep", "model": MODEL, "adapters": ["{adapter}"]},
            400,
        ),
        Op("GET", "/deployments/{deployment_id}", "/deployments/{deployment}"),
        Op("PATCH", "/deployments/{deployment_id}", "/deployments/{deployment}", {"status": "stopped"}),
        Op("DELETE", "/deployments/{deployment_id}", "/deployments/{deployment}"),
    ],
    "models": [  # the shared catalogue: read by all admins, written by platform admins
        Op("GET", "/models", "/models", admin=200),
        Op("POST", "/models", "/models", {"name": "m9", "source": "/models/m9"}, admin=403),
        Op("GET", "/models/{model_id}", "/models/{model}", admin=200),
        Op("PATCH", "/models/{model_id}", "/models/{model}", {"context_length": 16}, admin=403),
        Op("DELETE", "/models/{model_id}", "/models/{model}", admin=403),
    ],
    "plans": [  # B's plan is shared catalogue too: readable, not writable
        Op("GET", "/plans", "/plans", admin=200),
        Op("POST", "/plans", "/plans", {"name": "free-lunch"}, admin=403),
        Op("GET", "/plans/{plan_id}", "/plans/{plan}", admin=200),
        Op("PATCH", "/plans/{plan_id}", "/plans/{plan}", {"requests_per_minute": 1}, admin=403),
        Op("DELETE", "/plans/{plan_id}", "/plans/{plan}", admin=403),
    ],
    "audit": [
        Op("GET", "/audit", "/audit", admin=200),
        Op("GET", "/audit", "/audit?org_id={org}"),
        Op("GET", "/audit", "/audit?resource_id={key}", admin=200),  # answered, but empty
        Op("GET", "/audit", "/audit?actor_key_id={key_b_admin}", admin=200),
    ],
    "prices": [
        Op("GET", "/prices/models", "/prices/models", admin=200),
        Op("POST", "/prices/models", "/prices/models", SLOW_PRICE, admin=403),
        Op("GET", "/prices/gpus", "/prices/gpus", admin=200),
        Op("POST", "/prices/gpus", "/prices/gpus", {"gpu_type": "h100", "per_hour": "1"}, admin=403),
    ],
    "usage": [  # per-request usage and rollups, through the exports and the rollup job
        Op("GET", "/exports/{what}", "/exports/usage?org={org}&from=2025-01&to=2025-02"),
        Op("GET", "/exports/{what}", "/exports/usage?org={org_name}&format=json"),
        Op("GET", "/exports/{what}", "/exports/rollups?org={org}"),
        Op("GET", "/exports/{what}", "/exports/usage?from=2025-01&to=2025-02", admin=200),  # A's own only
        Op("POST", "/rollups", "/rollups", {"from": "2025-01", "to": "2025-02"}, admin=403),
        # usage grouped and priced
        Op("GET", "/usage", "/usage?org={org}"),
        Op("GET", "/usage", "/usage?key={key}&group_by=key"),
        Op("GET", "/usage", "/usage?key={key_prefix}"),
        Op("GET", "/usage", "/usage?group_by=org,model,key&from=2025-01", admin=200),  # A's own only
    ],
    "invoices": [
        Op("GET", "/invoices", "/invoices", admin=200),  # A's own only
        Op("GET", "/invoices", "/invoices?org={org}"),
        Op("GET", "/invoices", "/invoices?org={org_name}&month=2025-01"),
        Op("POST", "/invoices/generate", "/invoices/generate", {"month": "2025-01"}, admin=403),
        Op("GET", "/invoices/{invoice_id}", "/invoices/{invoice}"),
        Op("GET", "/invoices/{invoice_id}/pdf", "/invoices/{invoice}/pdf"),
        Op("POST", "/invoices/{invoice_id}/finalize", "/invoices/{invoice}/finalize?force=true"),
        Op("GET", "/exports/{what}", "/exports/invoices?org={org}&from=2025-01"),
        Op("GET", "/exports/{what}", "/exports/invoices?from=2025-01&to=2025-02", admin=200),
    ],
}


@dataclass
class World:
    """Organisation B with one of everything, and A's member and org-admin keys."""

    ids: dict[str, str]  # B's, by placeholder name
    member_a: str
    admin_a: str
    admin_b: str


def _fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    return value


async def make_world(env: AdminEnv, adapter_files: dict[str, bytes]) -> World:
    c, root = env.client, env.root
    a, b = await env.org("org-a"), await env.org("org-b")
    member_a = (await env.member_key(a.id))["secret"]
    plan = (await c.post(f"{API}/plans", headers=root, json={"name": "b-plan"})).json()
    assert (
        await c.patch(f"{API}/organizations/{b.id}", headers=root, json={"plan_id": plan["id"]})
    ).status_code == 200
    user = (
        await c.post(
            f"{API}/organizations/{b.id}/users",
            headers=b.headers,
            json={"email": "bob@b.io", "password": "b" * 12},
        )
    ).json()
    key = (await c.post(f"{API}/organizations/{b.id}/keys", headers=b.headers, json={"name": "b-key"})).json()
    r = await env.upload(b.id, b.headers, adapter_files, name="b-lora")
    assert r.status_code == 201, r.text
    adapter = r.json()
    r = await c.post(
        f"{API}/deployments",
        headers=b.headers,
        json={"name": "b-dedicated", "model": MODEL, "gpu_type": GPU, "adapters": [adapter["id"]]},
    )
    assert r.status_code == 201, r.text
    dep = r.json()
    model = (await c.get(f"{API}/models/{MODEL}", headers=root)).json()
    async with env.app.state.sessionmaker() as s, s.begin():
        invoice = Invoice(
            org_id=b.id,
            period_start=datetime(2025, 1, 1, tzinfo=UTC),
            period_end=datetime(2025, 2, 1, tzinfo=UTC),
            currency="usd",
        )
        s.add(invoice)
        await s.flush()
        invoice_id = invoice.id
    b_admin_key = (await c.get(f"{API}/keys/{b.admin_key[:11]}", headers=root)).json()
    ids = {
        "org": b.id,
        "org_name": "org-b",
        "user": user["id"],
        "key": key["id"],
        "key_prefix": key["prefix"],
        "key_b_admin": b_admin_key["id"],
        "adapter": adapter["id"],
        "deployment": dep["id"],
        "model": model["id"],
        "plan": plan["id"],
        "invoice": invoice_id,
    }
    return World(ids, member_a, a.admin_key, b.admin_key)


async def attempt(
    env: AdminEnv, op: Op, key: str, ids: dict[str, str], files: dict[str, bytes]
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    url = API + _fill(op.path, ids)
    if op.upload:
        return await env.client.post(
            url,
            headers=headers,
            data={"name": "planted-lora", "model": MODEL},
            files=[("file", (n, content, "application/octet-stream")) for n, content in files.items()],
        )
    body = _fill(op.body, ids)
    return await env.client.request(op.method, url, headers=headers, json=body)


def _error(r: httpx.Response, status: int, what: str) -> dict[str, Any]:
    assert r.status_code == status, f"{what}: {r.status_code} {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    return dict(err)


async def assert_b_untouched(env: AdminEnv, world: World) -> None:
    c, root, ids = env.client, env.root, world.ids
    org = (await c.get(f"{API}/organizations/{ids['org']}", headers=root)).json()
    assert (org["name"], org["status"], org["plan_id"]) == ("org-b", "active", ids["plan"])
    assert (await c.get(f"{API}/users/{ids['user']}", headers=root)).json()["disabled"] is False
    assert [
        u["id"] for u in (await c.get(f"{API}/organizations/{ids['org']}/users", headers=root)).json()
    ] == [ids["user"]]
    key = (await c.get(f"{API}/keys/{ids['key']}", headers=root)).json()
    assert (key["name"], key["revoked_at"]) == ("b-key", None)
    keys = (await c.get(f"{API}/organizations/{ids['org']}/keys", headers=root)).json()
    assert len(keys) == 2 and all(k["revoked_at"] is None for k in keys)  # B's admin key and b-key
    adapters = (await c.get(f"{API}/organizations/{ids['org']}/adapters", headers=root)).json()
    assert [x["name"] for x in adapters] == ["b-lora"]
    dep = (await c.get(f"{API}/deployments/{ids['deployment']}", headers=root)).json()
    assert (dep["status"], dep["adapters"]) == ("active", [ids["adapter"]])
    invoice = (await c.get(f"{API}/invoices/{ids['invoice']}", headers=root)).json()
    assert (invoice["status"], invoice["number"]) == ("draft", None)
    assert (await c.get(f"{API}/plans/{ids['plan']}", headers=root)).json()["requests_per_minute"] is None
    assert (await c.get(f"{API}/models/{ids['model']}", headers=root)).json()["context_length"] == 8192
    # B's key still works at the gateway
    r = await c.get("/v1/models", headers={"authorization": f"Bearer {world.admin_b}"})
    assert r.status_code == 200 and "b-dedicated" in r.text


@pytest.mark.parametrize("resource", sorted(CASES))
async def test_other_organisations_resources_are_out_of_reach(
    admin_env: AdminEnv, good_adapter: dict[str, bytes], resource: str
) -> None:
    world = await make_world(admin_env, good_adapter)
    ids = world.ids
    secret_ids = {v for k, v in ids.items() if k not in ("model", "plan", "org_name")}
    for op in CASES[resource]:
        what = f"{op.method} {op.path}"
        # a member key of A: the admin API is not for it, whatever is asked
        err = _error(await attempt(admin_env, op, world.member_a, ids, good_adapter), 403, f"member {what}")
        assert err["code"] == "insufficient_permissions", what
        # an org admin of A
        r = await attempt(admin_env, op, world.admin_a, ids, good_adapter)
        if op.admin == 200:
            assert r.status_code == 200, f"org admin {what}: {r.status_code} {r.text}"
            leaked = sorted(i for i in secret_ids if i in r.text)
            assert leaked == [], f"org admin {what} shows B's {leaked}"
        else:
            err = _error(r, op.admin, f"org admin {what}")
            if op.admin == 404:
                assert err["type"] == "not_found_error", what
            if op.admin == 403:
                assert err["code"] == "insufficient_permissions", what
            # the answer says no more than was asked: none of B's ids the request did not name
            asked = _fill(op.path, ids) + repr(_fill(op.body, ids))
            assert not [i for i in secret_ids if i in err["message"] and i not in asked], err
    await assert_b_untouched(admin_env, world)


async def test_every_admin_operation_has_a_role_case(admin_env: AdminEnv) -> None:
    """A new /admin/v1 endpoint without a row in CASES fails here."""
    doc = (await admin_env.client.get("/openapi.json")).json()
    documented = {
        (method.upper(), path.removeprefix(API))
        for path, item in doc["paths"].items()
        if path.startswith(API + "/")
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }
    covered = {(op.method, op.route) for ops in CASES.values() for op in ops}
    assert documented - covered == set(), "admin operations without a role test"
    assert covered - documented == set(), "role cases of operations that no longer exist"


# --- bad input: a 4xx with a clear message ----------------------------------------------------

BAD: list[tuple[str, str, Any, int, str | None]] = [
    # method, path ({org}, {user}, {key}, {deployment} of the default organisation), body, status, param
    ("POST", "/organizations", {"name": ""}, 400, "name"),
    ("POST", "/organizations", {"name": "x", "owner": "me"}, 400, "owner"),
    ("POST", "/organizations", ["not", "an", "object"], 400, None),
    ("PATCH", "/organizations/{org}", {"status": "suspended"}, 400, "status"),
    ("PATCH", "/organizations/{org}", {"plan_id": "plan_nope"}, 400, "plan_id"),
    ("PATCH", "/users/{user}", {"role": "god"}, 400, "role"),
    ("PATCH", "/users/{user}", {"password": "short"}, 400, "password"),
    ("PATCH", "/users/{user}", {"email": "x@y.io"}, 400, "email"),
    ("PATCH", "/keys/{key}", {"requests_per_minute": 0}, 400, "requests_per_minute"),
    ("PATCH", "/keys/{key}", {"secret": "tm-mine"}, 400, "secret"),
    ("PATCH", "/deployments/{deployment}", {"max_replicas": 0}, 400, "max_replicas"),
    ("PATCH", "/deployments/{deployment}", {"status": "paused"}, 400, "status"),
    ("PATCH", "/models/{model}", {"context_length": -5}, 400, "context_length"),
    ("PATCH", "/plans/{plan}", {"budget_mode": "strict"}, 400, "budget_mode"),
    ("POST", "/rollups", {"from": "2025-01", "to": "soon"}, 400, "to"),
    ("POST", "/invoices/generate", {"month": "2025-13"}, 400, "month"),
    ("GET", "/exports/usage?format=xml", None, 400, "format"),
    ("GET", "/usage?group_by=colour", None, 400, "group_by"),
    ("GET", "/usage?from=2025-02&to=2025-01", None, 400, "to"),
    ("GET", "/exports/secrets", None, 404, None),
    ("GET", "/audit?until=later", None, 400, "until"),
    ("GET", "/keys/key_nope", None, 404, None),
    ("GET", "/users/user_nope", None, 404, None),
    ("GET", "/adapters/adapter_nope", None, 404, None),
    ("GET", "/deployments/dep_nope", None, 404, None),
    ("GET", "/invoices/inv_nope", None, 404, None),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), BAD)
async def test_bad_input_is_a_4xx_saying_what_is_wrong(
    admin_env: AdminEnv, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    c, root = admin_env.client, admin_env.root
    org = admin_env.default_org
    user = (
        await c.post(
            f"{API}/organizations/{org}/users", headers=root, json={"email": "u@d.io", "password": "p" * 12}
        )
    ).json()
    key = (await c.post(f"{API}/organizations/{org}/keys", headers=root, json={"name": "k"})).json()
    dep = (
        await c.post(
            f"{API}/deployments",
            headers=root,
            json={"name": "d1", "model": MODEL, "org_id": org, "gpu_type": GPU},
        )
    ).json()
    plan = (await c.post(f"{API}/plans", headers=root, json={"name": "p1"})).json()
    model = (await c.get(f"{API}/models/{MODEL}", headers=root)).json()
    ids = {"org": org, "user": user["id"], "key": key["id"], "deployment": dep["id"], "plan": plan["id"]}
    ids["model"] = model["id"]
    r = await c.request(method, API + path.format(**ids), headers=root, json=body)
    err = _error(r, status, f"{method} {path}")
    assert len(err["message"]) > 10, err
    if param is not None:
        assert err["param"] == param, err
