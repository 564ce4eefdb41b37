"""The dashboard's lists with their search box and pager: organisations, an organisation's
users, API keys, adapters, deployments and invoices page by 50 with links that keep the
organisation and the search, say when a search finds nothing, and (on SQLite and PostgreSQL)
an organisation admin's pages and searches never show another organisation's rows; the admin
API's lists take the same `q`, `limit`, `after` and `before` and name the next page in a
`Link` header."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from billing.models import Invoice
from control_plane.catalog.models import Adapter, Deployment, Model
from control_plane.orgs.models import ApiKey, User
from tests.control_plane.conftest import AdminEnv
from tests.dashboard.conftest import Session, add_user, sign_in

API = "/admin/v1"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


async def _org(env: AdminEnv, name: str, keys: int = 0) -> str:
    """An organisation with `keys` keys (key-000, ...; created a second apart, in pairs),
    two adapters, a dedicated deployment and an invoice, all carrying its name."""
    r = await env.client.post(f"{API}/organizations", headers=env.root, json={"name": name})
    assert r.status_code == 201, r.text
    org_id = str(r.json()["id"])
    async with env.app.state.sessionmaker() as s, s.begin():
        model_id = (await s.scalars(select(Model.id))).first()
        for i in range(keys):
            s.add(
                ApiKey(
                    org_id=org_id,
                    name=f"{name}-key-{i:03d}",
                    prefix=f"tm-{name[:2]}{i:04d}x",
                    hash="h",
                    created_at=T0 + timedelta(seconds=i // 2),
                )
            )
        for n in ("lora-one", "lora-two"):
            s.add(Adapter(org_id=org_id, model_id=model_id, name=f"{name}-{n}", source="s3://x"))
        s.add(Deployment(name=f"{name}-dedicated", model_id=model_id, org_id=org_id, type="dedicated"))
        start = datetime(2025, 5, 1, tzinfo=UTC)
        s.add(
            Invoice(
                org_id=org_id, period_start=start, period_end=datetime(2025, 6, 1, tzinfo=UTC), currency="usd"
            )
        )
    return org_id


async def _root(env: AdminEnv) -> Session:
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    return await sign_in(str(env.client.base_url), "root@example.com")


def _ids(page: str, attr: str) -> list[str]:
    return re.findall(rf'data-{attr}="([^"]+)"', page)


def _link(page: str, cls: str) -> str | None:
    found = re.search(rf'<a href="([^"]+)"(?: rel="[a-z]+")? class="{cls}"', page)
    return html.unescape(found.group(1)).removeprefix("/dashboard") if found else None


def _empty(page: str) -> str:
    found = re.search(r'class="muted empty">([^<]*)<', page)
    assert found, "no empty-state row"
    return html.unescape(found.group(1))


async def test_the_keys_page_pages_by_50_keeping_organisation_and_search(env: AdminEnv) -> None:
    org = await _org(env, "acme", keys=120)
    s = await _root(env)
    r = await s.get(f"/keys?org={org}")
    assert r.status_code == 200
    pages = [r.text]
    assert _link(r.text, "prev") is None and _link(r.text, "first") is None
    while (nxt := _link(pages[-1], "next")) is not None:
        assert f"org={org}" in nxt and "after=" in nxt
        r = await s.get(nxt)
        assert r.status_code == 200, r.text[:500]
        pages.append(r.text)
    seen = [k for p in pages for k in _ids(p, "key")]
    assert [len(_ids(p, "key")) for p in pages] == [50, 50, 20]
    assert len(seen) == len(set(seen)) == 120
    # newest first: key-119 (the last created) leads, key-000 closes
    names = [n for p in pages for n in re.findall(r'<th scope="row">(acme-key-\d+)</th>', p)]
    assert names[0] in ("acme-key-119", "acme-key-118") and names[-1] in ("acme-key-000", "acme-key-001")
    # back from the last page: the middle one again, then the first
    prev = _link(pages[-1], "prev")
    assert prev is not None and "before=" in prev
    back = await s.get(prev)
    assert _ids(back.text, "key") == _ids(pages[1], "key")
    first = _link(back.text, "first")
    assert first == f"/keys?org={org}"
    # a search: 10 keys, one page, the organisation kept in the form and links
    r = await s.get(f"/keys?org={org}&q=ACME-KEY-07")
    assert len(_ids(r.text, "key")) == 10 and _link(r.text, "next") is None
    assert f'<input type="hidden" name="org" value="{org}">' in r.text
    assert 'value="ACME-KEY-07"' in r.text
    r = await s.get(f"/keys?org={org}&q=acme-key-0")  # 100 of them: two pages, search kept
    nxt = _link(r.text, "next")
    assert nxt is not None and "q=acme-key-0" in nxt and f"org={org}" in nxt
    r = await s.get(nxt)
    assert len(_ids(r.text, "key")) == 50
    clear = _link(r.text, "clear-search")
    assert clear == f"/keys?org={org}"
    r = await s.get(f"/keys?org={org}&q=nothing")
    assert _ids(r.text, "key") == [] and _empty(r.text) == "No keys match 'nothing'."
    # a cursor from nowhere is a page that says so, not a crash
    r = await s.get(f"/keys?org={org}&after=key_missing")
    assert r.status_code == 400 and "No row 'key_missing'" in html.unescape(r.text)


async def test_an_organisations_users_page_by_50_searched_by_email(env: AdminEnv) -> None:
    org = await _org(env, "acme")
    async with env.app.state.sessionmaker() as session, session.begin():
        users = [
            User(org_id=org, email=f"user{i:03d}@acme.test", created_at=T0 + timedelta(seconds=i))
            for i in range(60)
        ]
        session.add_all(users)
        await session.flush()
        session.add(ApiKey(org_id=org, user_id=users[-1].id, name="owned", prefix="tm-owned0001", hash="h"))
    s = await _root(env)
    r = await s.get(f"/orgs/{org}")
    assert r.status_code == 200
    first = re.findall(r"user(\d{3})@acme\.test</th>", r.text)
    assert first == [f"{i:03d}" for i in range(50)]  # oldest first
    nxt = _link(r.text, "next")
    assert nxt is not None and nxt.startswith(f"/orgs/{org}?after=")
    r = await s.get(nxt)
    assert re.findall(r"user(\d{3})@acme\.test</th>", r.text) == [f"{i:03d}" for i in range(50, 60)]
    assert _link(r.text, "next") is None and _link(r.text, "first") == f"/orgs/{org}"
    r = await s.get(f"/orgs/{org}?q=USER05")
    assert re.findall(r"user(\d{3})@acme\.test</th>", r.text) == [f"05{i}" for i in range(10)]
    r = await s.get(f"/orgs/{org}?q=nobody")
    assert _ids(r.text, "user") == [] and _empty(r.text) == "No users match 'nobody'."
    # the keys page names each shown key's owner
    r = await s.get(f"/keys?org={org}")
    assert "user059@acme.test" in r.text
    # the admin API pages the same list
    r = await env.client.get(f"{API}/organizations/{org}/users", headers=env.root, params={"limit": 20})
    assert [u["email"] for u in r.json()] == [f"user{i:03d}@acme.test" for i in range(20)]
    assert 'rel="next"' in r.headers["link"]
    r = await env.client.get(f"{API}/organizations/{org}/users", headers=env.root, params={"q": "user059"})
    assert [u["email"] for u in r.json()] == ["user059@acme.test"] and "link" not in r.headers


async def test_every_list_page_searches(env: AdminEnv) -> None:
    acme, globex = await _org(env, "acme"), await _org(env, "globex")
    s = await _root(env)
    r = await s.get("/orgs?q=GLOB")
    assert _ids(r.text, "org") == [globex]
    r = await s.get("/orgs?q=zzz")
    assert _ids(r.text, "org") == [] and _empty(r.text) == "No organisations match 'zzz'."
    r = await s.get(f"/models?org={acme}&q=TWO")
    assert len(_ids(r.text, "adapter")) == 1 and "acme-lora-two" in r.text and "acme-lora-one" not in r.text
    r = await s.get(f"/models?org={acme}&q=nope")
    assert _empty(r.text) == "No adapters match 'nope'."
    r = await s.get("/deployments?q=globex")
    assert "globex-dedicated" in r.text and "acme-dedicated" not in r.text
    r = await s.get("/deployments?q=smollm2")  # by base model: all of them
    assert {"acme-dedicated", "globex-dedicated"} <= set(re.findall(r">([a-z]+-dedicated)</a>", r.text))
    r = await s.get("/invoices?q=globex")
    async with env.app.state.sessionmaker() as session:
        globex_invoice = await session.scalar(select(Invoice.id).where(Invoice.org_id == globex))
    assert _ids(r.text, "invoice") == [globex_invoice]
    r = await s.get("/invoices?q=globex&status=finalized")
    assert _ids(r.text, "invoice") == [] and _empty(r.text) == "No invoices match 'globex'."


async def test_an_organisation_admin_never_pages_into_another(admin_env: AdminEnv) -> None:
    env = admin_env
    alpha, bravo = await _org(env, "alpha", keys=60), await _org(env, "bravo", keys=60)
    await add_user(env, alpha, "admin@alpha.test", "org_admin")
    s = await sign_in(str(env.client.base_url), "admin@alpha.test")
    seen: list[str] = []
    r = await s.get("/keys")
    while True:
        assert "bravo" not in r.text
        seen += _ids(r.text, "key")
        if (nxt := _link(r.text, "next")) is None:
            break
        r = await s.get(nxt)
    assert len(set(seen)) == len(seen) == 60
    async with env.app.state.sessionmaker() as session:
        bravo_key = await session.scalar(select(ApiKey.id).where(ApiKey.org_id == bravo))
        alpha_key = await session.scalar(select(ApiKey.id).where(ApiKey.org_id == alpha))
    assert bravo_key not in seen and alpha_key in seen
    # searches for bravo's things find nothing, on every list
    for path in ("/keys?q=bravo", "/models?q=bravo", "/deployments?q=bravo", "/invoices?q=bravo"):
        r = await s.get(path)
        assert r.status_code == 200, path
        assert "bravo" not in r.text.replace("q=bravo", "").replace('value="bravo"', "").replace(
            "match &#39;bravo&#39;", ""
        ), path
    # bravo by name or id is a 404 page; a cursor of bravo's is not found in alpha's list
    for path in (f"/keys?org={bravo}", f"/models?org={bravo}", f"/invoices?org={bravo}", "/keys?org=bravo"):
        assert (await s.get(path)).status_code == 404, path
    r = await s.get(f"/keys?after={bravo_key}")
    assert r.status_code == 400 and "bravo" not in r.text.replace(bravo_key, "")
    # the admin API: alpha's org admin key pages alpha's keys, and bravo's not at all
    key = (
        await env.client.post(
            f"{API}/organizations/{alpha}/keys", headers=env.root, json={"role": "org_admin"}
        )
    ).json()
    h = {"authorization": f"Bearer {key['secret']}"}
    assert (
        await env.client.get(f"{API}/organizations/{bravo}/keys", headers=h, params={"q": "b"})
    ).status_code == 404
    r = await env.client.get(f"{API}/organizations/{alpha}/keys", headers=h, params={"after": bravo_key})
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    r = await env.client.get(f"{API}/organizations", headers=h, params={"q": "bravo"})
    assert r.json() == []


async def test_the_admin_api_lists_page_with_a_link_header(env: AdminEnv) -> None:
    org = await _org(env, "acme", keys=25)
    c, h = env.client, env.root
    # without limit: every key, oldest first, as before paging existed; no Link header
    r = await c.get(f"{API}/organizations/{org}/keys", headers=h)
    everything = [k["id"] for k in r.json()]
    assert len(everything) == 25 and "link" not in r.headers
    # with it: pages; the Link header names the next one, the query kept
    seen: list[str] = []
    url: str | None = f"{API}/organizations/{org}/keys?limit=10&q=acme"
    while url is not None:
        r = await c.get(url, headers=h)
        assert r.status_code == 200, r.text
        seen += [k["id"] for k in r.json()]
        found = re.search(r'<([^>]+)>; rel="next"', r.headers.get("link", ""))
        url = found.group(1) if found else None
        if url is not None:
            assert "limit=10" in url and "q=acme" in url
    assert seen == everything
    r = await c.get(f"{API}/organizations/{org}/keys", headers=h, params={"limit": 10, "order": "desc"})
    assert [k["id"] for k in r.json()] == everything[::-1][:10]
    prev = await c.get(f"{API}/organizations/{org}/keys", headers=h, params={"limit": 10, "before": seen[20]})
    assert [k["id"] for k in prev.json()] == seen[10:20] and 'rel="prev"' in prev.headers["link"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"order": "up"}, "order")):
        r = await c.get(f"{API}/organizations/{org}/keys", headers=h, params=params)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    # the other lists take the same parameters
    r = await c.get(f"{API}/organizations/{org}/adapters", headers=h, params={"q": "ONE"})
    assert [a["name"] for a in r.json()] == ["acme-lora-one"]
    r = await c.get(f"{API}/deployments", headers=h, params={"q": "acme", "limit": 1})
    assert [d["name"] for d in r.json()] == ["acme-dedicated"] and "link" not in r.headers
    r = await c.get(f"{API}/organizations", headers=h, params={"limit": 1})
    assert len(r.json()) == 1 and 'rel="next"' in r.headers["link"]
    r = await c.get(f"{API}/invoices", headers=h, params={"q": "acme", "limit": 5})
    assert [i["org_id"] for i in r.json()] == [org]
