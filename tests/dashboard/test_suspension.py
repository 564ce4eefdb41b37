"""The dashboard under the admin API's rules for a suspended organisation: its admins are
refused every page but its invoices and usage (and signing out), until it is resumed; the
platform admin's suspend form holds its deployments at zero like the API's."""

from __future__ import annotations

from control_plane.policy import SUSPENDED
from tests.control_plane.conftest import GPU, MODEL, AdminEnv
from tests.dashboard.conftest import add_user, sign_in

API = "/admin/v1"


async def test_a_suspended_organisations_admin_reads_only_invoices_and_usage(env: AdminEnv) -> None:
    org = await env.org("acme")
    dep = await env.client.post(
        f"{API}/deployments", headers=org.headers, json={"name": "acme-dep", "model": MODEL, "gpu_type": GPU}
    )
    assert dep.status_code == 201, dep.text
    await add_user(env, org.id, "ada@acme.io", "org_admin")
    await add_user(env, env.default_org, "root@tokenmill.test", "platform_admin")
    ada = await sign_in(str(env.client.base_url), "ada@acme.io")
    root = await sign_in(str(env.client.base_url), "root@tokenmill.test")
    assert (await ada.get("/keys")).status_code == 200

    r = await root.post(f"/orgs/{org.id}/status", {"status": "suspended"})
    assert r.status_code == 303
    got = (await env.client.get(f"{API}/deployments/{dep.json()['id']}", headers=env.root)).json()
    assert got["status"] == SUSPENDED  # held at zero replicas, as through the API
    for page in ("/", "/keys", "/models", "/deployments", f"/orgs/{org.id}", "/prices"):
        r = await ada.get(page)
        assert r.status_code == 403 and "suspended" in r.text, page
    for page in ("/invoices", "/usage", "/usage.csv"):
        assert (await ada.get(page)).status_code == 200, page
    # changes are refused too, not only pages
    r = await ada.post("/keys", {"org": org.id, "name": "more"})
    assert r.status_code == 403
    keys = (await env.client.get(f"{API}/organizations/{org.id}/keys", headers=env.root)).json()
    assert [k["name"] for k in keys] == [""]  # the org admin key env.org made, nothing more

    assert (await ada.post("/logout")).status_code == 303  # signing out always works
    await ada.client.aclose()

    await root.post(f"/orgs/{org.id}/status", {"status": "active"})
    ada = await sign_in(str(env.client.base_url), "ada@acme.io")
    assert (await ada.get("/keys")).status_code == 200
    for session in (ada, root):
        await session.client.aclose()
