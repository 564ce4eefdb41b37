"""The audit-log page (`/dashboard/audit`): every admin change newest first, with who made it
(a user's email, an API key's prefix, the system), what, the resource and its before/after
(never a secret); filters by organisation, resource type, action, actor, dates and a search,
paged by 50. An organisation admin reads their own organisation's entries only, on SQLite and
PostgreSQL: another organisation is a 404, its entries never appear (not through a search
either), and a platform admin acting on theirs is named by role, not by email."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from control_plane.audit.models import AuditEntry
from tests.control_plane.conftest import AdminEnv
from tests.dashboard.conftest import PASSWORD, Session, add_user, sign_in

API = "/admin/v1"


def _entries(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'data-entry="(\d+)"', page)]


def _rows(page: str) -> list[str]:
    """Each entry's table row, as text."""
    return re.findall(
        r'<tr data-entry="\d+".*?</tr>\s*(?=<tr data-entry|</tbody>\s*</table>\s*</div>)', page, re.S
    )


def _link(page: str, cls: str) -> str | None:
    found = re.search(rf'<a href="([^"]+)"(?: rel="[a-z]+")? class="{cls}"', page)
    return html.unescape(found.group(1)).removeprefix("/dashboard") if found else None


async def _world(env: AdminEnv) -> dict[str, str]:
    """alpha and bravo, each with an org admin; the platform's root key and a signed-in
    platform admin change things in both; alpha's admin creates and revokes a key of theirs."""
    c, h = env.client, env.root
    ids: dict[str, str] = {}
    for name in ("alpha", "bravo"):
        org = (await c.post(f"{API}/organizations", headers=h, json={"name": name})).json()
        ids[name] = org["id"]
        await add_user(env, org["id"], f"admin@{name}.test", "org_admin")
        key = (
            await c.post(f"{API}/organizations/{org['id']}/keys", headers=h, json={"name": f"{name}-ci"})
        ).json()
        await c.patch(f"{API}/keys/{key['id']}", headers=h, json={"max_concurrent": 3})
        ids[f"{name}_key"], ids[f"{name}_secret"] = key["id"], key["secret"]
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    root = await sign_in(str(c.base_url), "root@platform.test")
    r = await root.post("/keys", {"org": ids["alpha"], "name": "made-by-root"})
    assert r.status_code == 303, r.text
    alpha = await sign_in(str(c.base_url), "admin@alpha.test")
    r = await alpha.post("/keys", {"org": ids["alpha"], "name": "own-key"})
    assert r.status_code == 303, r.text
    async with env.app.state.sessionmaker() as s:
        own = await s.scalar(
            select(AuditEntry.resource_id)
            .where(AuditEntry.action == "create", AuditEntry.org_id == ids["alpha"])
            .order_by(AuditEntry.id.desc())
        )
    assert own is not None
    ids["own_key"] = own
    r = await alpha.post(f"/keys/{own}/revoke")
    assert r.status_code == 303
    await root.client.aclose()
    await alpha.client.aclose()
    return ids


async def test_the_audit_log_page_filters_and_shows_each_change(env: AdminEnv) -> None:
    ids = await _world(env)
    s = await sign_in(str(env.client.base_url), "root@platform.test")
    r = await s.get("/audit")
    assert r.status_code == 200
    assert re.search(r'<a href="/dashboard/audit"[^>]*>Audit log</a>', r.text)  # in the navigation
    shown = _entries(r.text)
    async with env.app.state.sessionmaker() as session:
        stored = list(await session.scalars(select(AuditEntry).order_by(AuditEntry.id.desc())))
    assert shown == [e.id for e in stored][:50]  # newest first
    page = html.unescape(r.text)
    # who: the dashboard user by email, the API key by prefix, the first start as the system
    rows = {e.id: row for e, row in zip(stored, _rows(r.text), strict=False)}
    revoke = next(e for e in stored if e.action == "revoke")
    assert "admin@alpha.test" in rows[revoke.id]
    by_key = next(e for e in stored if e.action == "update" and e.resource_type == "api_key")
    assert f"{env.root_key[:11]}…" in html.unescape(rows[by_key.id])
    assert "system" in html.unescape(rows[stored[-1].id])  # the bootstrap's first entry
    # details: before and after, the changed field marked, no secret anywhere
    assert re.search(
        r'<tr class="changed"><th scope="row">max_concurrent</th>'
        r"<td><code>null</code></td><td><code>3</code>",
        r.text,
    )
    for secret in (env.root_key, ids["alpha_secret"], ids["bravo_secret"], PASSWORD):
        assert secret not in page
    assert ">hash<" not in r.text and ">password_hash<" not in r.text
    # filters
    r = await s.get("/audit?resource_type=api_key&action=revoke")
    assert _entries(r.text) == [revoke.id]
    r = await s.get("/audit?actor=admin@alpha.test")
    assert {
        e.id
        for e in stored
        if e.actor_user_id
        and e.org_id == ids["alpha"]
        and e.action in ("create", "revoke")
        and e.resource_id == ids["own_key"]
    } == set(_entries(r.text))
    r = await s.get(f"/audit?actor={env.root_key[:11]}")
    assert set(_entries(r.text)) == {e.id for e in stored if e.actor_key_id and not e.actor_user_id}
    r = await s.get(f"/audit?org={ids['bravo']}")
    assert set(_entries(r.text)) == {e.id for e in stored if e.org_id == ids["bravo"]}
    assert "selected>bravo</option>" in r.text
    r = await s.get(f"/audit?q={ids['alpha_key'][-8:].upper()}")  # by resource id, any case
    assert set(_entries(r.text)) == {e.id for e in stored if e.resource_id == ids["alpha_key"]}
    r = await s.get("/audit?q=admin@alpha")  # by the actor's email
    assert set(_entries(r.text)) == {
        e.id for e in stored if e.actor_user_id and e.resource_id == ids["own_key"]
    }
    today = datetime.now(UTC).date()
    r = await s.get(f"/audit?from={today + timedelta(days=1)}")
    assert _entries(r.text) == [] and "No entries match these filters." in r.text
    r = await s.get(f"/audit?from={today}&to={today}")
    assert len(_entries(r.text)) == min(50, len(stored))
    r = await s.get(f"/audit?to={today - timedelta(days=1)}")
    assert _entries(r.text) == []
    # a bad date: the page again with the message, every filter as typed
    r = await s.get("/audit?from=yesterday&action=revoke&q=abc")
    assert r.status_code == 400
    assert "from must be an ISO 8601 date" in html.unescape(r.text)
    assert 'value="revoke" selected' in r.text and 'value="abc"' in r.text and 'value="yesterday"' in r.text
    assert 'aria-current="page">Audit log</a>' in r.text  # with the navigation
    r = await s.get(f"/audit?from={today}&to={today - timedelta(days=2)}")
    assert r.status_code == 400 and "'to' must not be before 'from'." in html.unescape(r.text)
    await s.client.aclose()


async def test_the_audit_log_pages_by_50(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    at = datetime(2026, 1, 5, tzinfo=UTC)
    async with env.app.state.sessionmaker() as session, session.begin():
        session.add_all(
            AuditEntry(
                at=at, org_id=env.default_org, action="update", resource_type="plan", resource_id=f"plan_{i}"
            )
            for i in range(130)
        )
    async with env.app.state.sessionmaker() as session:
        every = list(await session.scalars(select(AuditEntry.id).order_by(AuditEntry.id.desc())))
    s = await sign_in(str(env.client.base_url), "root@platform.test")
    r = await s.get("/audit?resource_type=plan")
    pages = [_entries(r.text)]
    while (nxt := _link(r.text, "next")) is not None:
        assert "resource_type=plan" in nxt
        r = await s.get(nxt)
        pages.append(_entries(r.text))
    assert [len(p) for p in pages] == [50, 50, 30]
    assert [i for p in pages for i in p] == every[:130]  # the plan entries are the newest
    prev = _link(r.text, "prev")
    assert prev is not None
    assert _entries((await s.get(prev)).text) == pages[1]
    await s.client.aclose()


async def test_an_organisation_admin_reads_their_own_audit_log_only(admin_env: AdminEnv) -> None:
    env = admin_env
    ids = await _world(env)
    s: Session = await sign_in(str(env.client.base_url), "admin@alpha.test")
    async with env.app.state.sessionmaker() as session:
        stored = list(await session.scalars(select(AuditEntry).order_by(AuditEntry.id.desc())))
    own = [e.id for e in stored if e.org_id == ids["alpha"]]
    r = await s.get("/audit")
    assert r.status_code == 200 and _entries(r.text) == own
    page = html.unescape(r.text)
    for marker in ("bravo", ids["bravo"], ids["bravo_key"], "root@platform.test", env.root_key[:11]):
        assert marker not in page, marker
    assert 'id="a-org"' not in r.text  # no organisation filter for them
    # the platform's changes to alpha are there, their author named by role
    made_by_root = next(
        e for e in stored if e.org_id == ids["alpha"] and e.actor_key_id and not e.actor_user_id
    )
    row = dict(zip(_entries(r.text), _rows(r.text), strict=True))[made_by_root.id]
    assert "a platform admin" in row
    # bravo, asked for by id or name: 404 like a missing one; searches never reach it
    for path in (f"/audit?org={ids['bravo']}", "/audit?org=bravo", "/audit?org=nope"):
        assert (await s.get(path)).status_code == 404, path
    for q in ("bravo", ids["bravo_key"], "root@platform", env.root_key[:11], "admin@bravo"):
        r = await s.get("/audit", params={"q": q})
        assert r.status_code == 200 and _entries(r.text) == [], q
    # naming the platform admin as the actor finds nothing either (they are not alpha's)
    r = await s.get("/audit", params={"actor": "root@platform.test"})
    assert _entries(r.text) == []
    r = await s.get("/audit", params={"actor": "admin@alpha.test"})
    assert _entries(r.text) and set(_entries(r.text)) <= set(own)
    # and the admin API agrees, with the same search
    key = (
        await env.client.post(
            f"{API}/organizations/{ids['alpha']}/keys", headers=env.root, json={"role": "org_admin"}
        )
    ).json()
    h = {"authorization": f"Bearer {key['secret']}"}
    r = await env.client.get(f"{API}/audit", headers=h, params={"q": "bravo"})
    assert r.json()["data"] == []
    r = await env.client.get(f"{API}/audit", headers=h, params={"org_id": ids["bravo"]})
    assert r.status_code == 404
    await s.client.aclose()
