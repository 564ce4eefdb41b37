"""The Limits page (and `GET /admin/v1/organizations/{org}/limits`, the same report): an
organisation's plan limits with their bursts, its keys' own limits, the last minute's
requests and tokens from the ledger, and the monthly budget against this month's spend,
priced as the gateway seeds its budget counter. An organisation admin sees their own
organisation's only (another's is a 404, on the page and on the admin API); the default
tier shows the platform's settings. Over HTTP on SQLite and PostgreSQL, and in Chromium."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from billing.common import month_bounds
from billing.ledger.services import record_usage
from billing.prices.services import PriceBook
from tests.control_plane.conftest import MODEL, AdminEnv
from tests.dashboard.browser import ARTIFACTS, launched, signed_in
from tests.dashboard.conftest import add_user, sign_in
from tokenmill.protocol import UsageRecord

API = "/admin/v1"
# 1,000 prompt tokens at 1,000 per 1M and 500 completion tokens at 2,000 per 1M: 2.00 a request.
PROMPT, COMPLETION = 1000, 500
PER_REQUEST = Decimal("2.00")


async def _world(env: AdminEnv) -> dict[str, Any]:
    """acme on plan "pro" (a hard budget of 10), with a key limited on its own; other on the
    default tier. acme's ledger: two requests earlier this month, three in the last minute
    by the limited key and one by another key; other's: one in the last minute."""
    c, root = env.client, env.root
    plan = {
        "name": "pro",
        "requests_per_minute": 100,
        "request_burst": 20,
        "tokens_per_minute": 50_000,
        "max_concurrent": 5,
        "monthly_budget": "10.00",
        "budget_mode": "hard",
    }
    r = await c.post(f"{API}/plans", headers=root, json=plan)
    assert r.status_code == 201, r.text
    acme, other = await env.org("acme"), await env.org("other")
    r = await c.patch(f"{API}/organizations/{acme.id}", headers=root, json={"plan_id": r.json()["id"]})
    assert r.status_code == 200, r.text
    await add_user(env, acme.id, "admin@acme.test", "org_admin")
    await add_user(env, other.id, "admin@other.test", "org_admin")
    made = {}
    for name, body in (("limited", {"requests_per_minute": 7, "token_burst": 900, "tokens_per_minute": 3000}),
                       ("plain", {})):  # fmt: skip
        r = await c.post(f"{API}/organizations/{acme.id}/keys", headers=root, json={"name": name, **body})
        assert r.status_code == 201, r.text
        made[name] = r.json()
    now = time.time()
    month = month_bounds(datetime.now(UTC))[0].timestamp()
    deps = (await c.get(f"{API}/deployments", headers=root)).json()
    shared = next(d["id"] for d in deps if d["type"] == "serverless")

    def record(i: int, org_id: str, key: str | None, ts: float) -> UsageRecord:
        return UsageRecord(
            request_id=f"req-{i}",
            org_id=org_id,
            model=MODEL,
            api_key_id=key,
            deployment_id=shared,
            prompt_tokens=PROMPT,
            completion_tokens=COMPLETION,
            ts=ts,
        )

    records = [
        record(1, acme.id, made["plain"]["id"], max(month + 1, now - 3600)),
        record(2, acme.id, made["plain"]["id"], max(month + 2, now - 300)),
        *(record(3 + i, acme.id, made["limited"]["id"], now - 20 + i) for i in range(3)),
        record(6, acme.id, made["plain"]["id"], now - 10),
        record(7, other.id, None, now - 10),
    ]
    async with env.app.state.sessionmaker() as session, session.begin():
        await PriceBook(session).add_model_price(
            model_ref=MODEL,
            input_per_mtok=Decimal("1000"),
            output_per_mtok=Decimal("2000"),
            effective_from=datetime.now(UTC) - timedelta(days=40),
        )
        await record_usage(session, records)
    return {"acme": acme, "other": other, "keys": made}


def _attrs(html: str, tag: str, marker: str) -> dict[str, str]:
    found = re.search(rf"<{tag} [^>]*{marker}[^>]*>", html)
    assert found, f"no {marker} on the page"
    return dict(re.findall(r'([\w-]+)="([^"]*)"', found.group(0)))


async def test_an_org_admin_sees_its_limits_and_budget_against_spend(admin_env: AdminEnv) -> None:
    env = admin_env
    world = await _world(env)
    acme, other = world["acme"], world["other"]
    base = str(env.client.base_url)
    s = await sign_in(base, "admin@acme.test")
    r = await s.get("/limits")
    assert r.status_code == 200, r.text
    page = r.text
    assert 'href="/dashboard/limits" aria-current="page"' in page  # in the navigation
    assert re.search(r'<dd id="plan">pro</dd>', page)
    requests = _attrs(page, "tr", 'data-limit="requests"')
    tokens = _attrs(page, "tr", 'data-limit="tokens"')
    concurrent = _attrs(page, "tr", 'data-limit="concurrent"')
    # the plan's limits, and acme's four requests of the last minute (the other org's not)
    assert (requests["data-allowed"], requests["data-burst"], requests["data-used"]) == ("100", "20", "4")
    assert (tokens["data-allowed"], tokens["data-burst"]) == ("50000", "50000")
    assert tokens["data-used"] == str(4 * (PROMPT + COMPLETION))
    assert concurrent["data-allowed"] == "5"
    budget = _attrs(page, "section", 'id="budget"')
    assert (Decimal(budget["data-budget"]), budget["data-mode"]) == (Decimal("10.00"), "hard")
    assert Decimal(budget["data-spent"]) == 6 * PER_REQUEST  # this month: all six of acme's
    assert "12.00 since" in page and "(120.0%)" in page  # over it
    limited = _attrs(page, "tr", f'data-key="{world["keys"]["limited"]["id"]}"')
    assert (limited["data-requests"], limited["data-tokens"]) == ("7", "3000")
    assert (limited["data-used-requests"], limited["data-used-tokens"]) == (
        "3",
        str(3 * (PROMPT + COMPLETION)),
    )
    assert "(burst 900)" in page
    assert world["keys"]["plain"]["id"] not in page  # no limits of its own: not listed

    # another organisation's: 404, on the page and on the admin API
    assert (await s.get(f"/limits?org={other.id}")).status_code == 404
    assert (await s.get(f"/limits?org={other.id}")).text.count(other.id) <= 1
    own = acme.headers
    assert (await env.client.get(f"{API}/organizations/{other.id}/limits", headers=own)).status_code == 404
    r = await env.client.get(f"{API}/organizations/{acme.id}/limits", headers=own)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["plan_name"] == "pro" and body["budget_mode"] == "hard"
    assert Decimal(body["monthly_budget"]) == Decimal("10.00")
    assert Decimal(body["spent_this_month"]) == 6 * PER_REQUEST
    assert body["limits"] == {
        "requests_per_minute": 100,
        "request_burst": 20,
        "tokens_per_minute": 50000,
        "token_burst": 50000,
        "max_concurrent": 5,
    }
    assert body["last_minute"] == {"requests": 4, "tokens": 4 * (PROMPT + COMPLETION)}
    assert [(k["name"], k["last_minute"]["requests"]) for k in body["keys"]] == [("limited", 3)]

    # the default tier: the platform's settings, no budget
    o = await sign_in(base, "admin@other.test")
    page = (await o.get("/limits")).text
    assert "default tier (no plan)" in page and "No budget" in page
    requests = _attrs(page, "tr", 'data-limit="requests"')
    settings = env.settings
    assert (requests["data-allowed"], requests["data-used"]) == (
        str(settings.default_requests_per_minute),
        "1",
    )
    assert _attrs(page, "tr", 'data-limit="concurrent"')["data-allowed"] == str(
        settings.default_max_concurrent
    )
    assert (await o.get(f"/limits?org={acme.id}")).status_code == 404
    # a platform admin: any organisation's
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    root = await sign_in(base, "root@platform.test")
    assert re.search(r'<dd id="plan">pro</dd>', (await root.get(f"/limits?org={acme.id}")).text)
    for session in (s, o, root):
        await session.client.aclose()


async def test_in_a_browser(env: AdminEnv, chromium: str) -> None:
    await _world(env)
    base = str(env.client.base_url)
    async with launched(chromium) as browser:
        page = await signed_in(browser, base, "admin@acme.test")
        await page.get_by_role("navigation", name="Main").get_by_role("link", name="Limits").click()
        await page.wait_for_url("**/dashboard/limits")
        assert await page.locator("h1").inner_text() == "Limits of acme"
        assert await page.locator("#plan").inner_text() == "pro"
        assert "12.00 since" in await page.locator("#spent").inner_text()
        assert Decimal(await page.locator("#budget meter").get_attribute("value") or "") == 6 * PER_REQUEST
        await page.screenshot(path=str(ARTIFACTS / "limits.png"), full_page=True)
        response = await page.goto(f"{base}/dashboard/limits?org=nonexistent")
        assert response is not None and response.status == 404
        await page.context.close()
