"""Every dashboard page in Chromium, at 1280x900 and at 390x844 (a phone), as a platform
admin with data on every page (two organisations with keys, adapters, dedicated deployments
with a live worker, usage, rollups and invoices): a full-page screenshot of each is written to
test-artifacts/dashboard/screens/<page>-<width>.png, nothing is wider than the screen (tables
scroll inside their box), and no label, button, select, table header or input is too narrow
for its text (its scroll width exceeds its box; a select, whose text the browser cuts without
scrolling, is measured against a copy of itself sized to the chosen option).

A page added to the dashboard is one line in PAGES."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
from playwright.async_api import Page

from dashboard import limits_pages
from tests.control_plane.conftest import AdminEnv
from tests.dashboard.browser import ARTIFACTS, DESKTOP, PHONE, launched, signed_in
from tests.dashboard.conftest import add_user, sign_in
from tests.dashboard.test_isolation import _world

SCREENS = ARTIFACTS / "screens"

# (name of the screenshot, path): {org}, {key}, {dep}, {shared} and {invoice} are the first
# organisation's (alpha's), the shared deployment's and its invoice's ids.
PAGES: list[tuple[str, str]] = [
    ("overview", "/"),
    ("overview-30d", "/?range=30d"),
    ("account", "/account"),
    ("orgs", "/orgs"),
    ("org", "/orgs/{org}"),
    ("keys", "/keys?org={org}"),
    ("key-created", "/keys/{key}/created"),
    ("models", "/models?org={org}"),
    ("deployments", "/deployments"),
    ("deployment", "/deployments/{dep}"),
    ("deployment-shared", "/deployments/{shared}"),
    ("batches", "/batches?org={org}"),
    ("usage", "/usage?org={org}&range=30d"),
    ("invoices", "/invoices"),
    ("invoice", "/invoices/{invoice}"),
    ("prices", "/prices"),
    ("limits", "/limits?org={org}"),
    ("audit", "/audit"),
]
# Pages that answer an error on purpose: inside the layout, with the navigation.
ERROR_PAGES: list[tuple[str, str, int]] = [
    ("not-found", "/no-such-page", 404),
    ("not-found-key", "/keys/key_missing/created", 404),
    ("bad-request", "/invoices?month=nope", 400),
]

# What is too narrow for its text, on the page as shown: [description, needed px, box px].
CLIPPED_JS = """
() => {
  const out = [];
  const shown = (el) => {
    if (el.closest('[hidden], .visually-hidden') || el.type === 'hidden') return false;
    const style = getComputedStyle(el);
    return style.display !== 'none' && style.visibility !== 'hidden' && el.getClientRects().length > 0;
  };
  const name = (el) => {
    const label = el.labels && el.labels[0] ? el.labels[0].textContent : '';
    const text = (label || el.textContent || el.value || el.name || '').trim().replace(/\\s+/g, ' ');
    return `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''} "${text.slice(0, 60)}"`;
  };
  for (const el of document.querySelectorAll('label, button, select, th, input')) {
    if (!shown(el)) continue;
    let need = el.scrollWidth;
    if (el.tagName === 'SELECT' && el.selectedIndex >= 0) {
      // A select cuts its text without scrolling: a copy holding only the chosen option,
      // at its natural width, is the width it needs.
      const copy = el.cloneNode(false);
      copy.removeAttribute('id');
      copy.add(new Option(el.options[el.selectedIndex].text));
      copy.style.cssText = 'position:absolute;visibility:hidden;width:auto;min-width:0;max-width:none';
      el.parentNode.appendChild(copy);
      need = copy.clientWidth;
      copy.remove();
    }
    if (need > el.clientWidth + 1) out.push([name(el), need, el.clientWidth]);
  }
  return out;
}
"""


async def _check(page: Page, name: str, width: int) -> list[str]:
    """The page's problems at this width (and its screenshot)."""
    problems = []
    overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    if overflow > 1:
        problems.append(f"{name} at {width}px: {overflow}px wider than the screen")
    for what, need, box in await page.evaluate(CLIPPED_JS):
        problems.append(f"{name} at {width}px: {what} needs {need}px, has {box}px")
    if await page.locator("h1").count() != 1:
        problems.append(f"{name} at {width}px: not one h1")
    await page.screenshot(path=str(SCREENS / f"{name}-{width}.png"), full_page=True)
    return problems


async def test_every_page_at_desktop_and_phone_width(env: AdminEnv, chromium: str) -> None:
    alpha, _, shared = await _world(env)
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    ids = {
        "org": alpha["org"]["id"],
        "key": alpha["key"]["id"],
        "dep": alpha["dep"]["id"],
        "shared": shared,
        "invoice": alpha["invoices"][0],
    }
    await asyncio.to_thread(shutil.rmtree, SCREENS, True)  # only this run's screenshots
    await asyncio.to_thread(SCREENS.mkdir, parents=True)
    base = str(env.client.base_url)
    problems: list[str] = []
    async with launched(chromium) as browser:
        for viewport in (DESKTOP, PHONE):
            width = viewport["width"]
            # the login page, signed out
            context = await browser.new_context(viewport=viewport)  # type: ignore[arg-type]
            login = await context.new_page()
            await login.goto(f"{base}/dashboard/login")
            problems += await _check(login, "login", width)
            await context.close()

            page = await signed_in(browser, base, "root@platform.test", viewport)
            # a new key's secret, as the form shows it
            await page.goto(f"{base}/dashboard/keys?org={ids['org']}")
            await page.locator("#new-key").get_by_label("Name").fill(f"screenshot-{width}")
            await page.get_by_role("button", name="Create key").click()
            await page.wait_for_url("**/created")
            problems += await _check(page, "key-created-secret", width)
            for name, path in PAGES:
                response = await page.goto(f"{base}/dashboard{path.format(**ids)}")
                status = response.status if response else None
                if status != 200:
                    problems.append(f"{name} at {width}px: {path} answered {status}")
                problems += await _check(page, name, width)
            for name, path, status in ERROR_PAGES:
                response = await page.goto(f"{base}/dashboard{path}")
                if (response.status if response else None) != status:
                    problems.append(f"{name} at {width}px: {path} did not answer {status}")
                # inside the layout: the navigation, who is signed in, a way back
                nav = page.get_by_role("navigation", name="Main")
                assert await nav.get_by_role("link", name="Overview").count() == 1, path
                assert await page.get_by_role("button", name="Sign out").count() == 1, path
                problems += await _check(page, name, width)
            await page.context.close()
    assert problems == [], "\n".join(problems)
    shots = {p.name for p in SCREENS.iterdir()}
    every = ["login", "key-created-secret", *(n for n, _ in PAGES), *(n for n, _, _ in ERROR_PAGES)]
    assert shots == {f"{n}-{w}.png" for n in every for w in (1280, 390)}


def test_the_page_list_names_every_page_the_dashboard_serves() -> None:
    """A new page (a GET route returning HTML) must be added to PAGES, or listed here as
    what it is instead."""
    from dashboard.controllers import PAGES as ROUTES

    not_pages = {
        # downloads, fragments and the catch-all
        "/usage.csv",
        "/refusals.csv",
        "/invoices/{invoice_id:str}/download/{fmt:str}",
        "/batches/{batch_id:str}/download/{kind:str}",
        "/deployments/{dep_id:str}/workers",
        "/{rest:path}",
    }
    served = {path for handler in ROUTES if "GET" in (handler.http_methods or ()) for path in handler.paths}
    listed = {path.split("?")[0] for _, path in PAGES}
    placeholders = {
        "/orgs/{org}": "/orgs/{org_id:str}",
        "/keys/{key}/created": "/keys/{key_id:str}/created",
        "/deployments/{dep}": "/deployments/{dep_id:str}",
        "/deployments/{shared}": "/deployments/{dep_id:str}",
        "/invoices/{invoice}": "/invoices/{invoice_id:str}",
    }
    covered = {placeholders.get(p, p) for p in listed}
    assert served - not_pages - covered == set(), "pages missing from PAGES"


async def test_error_pages_are_inside_the_layout(env: AdminEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """404, 400, 403 and 500 pages: the navigation and who is signed in when the page knows
    (the 403 of a suspended organisation's admin too), a link back to the page that led
    there, and never a bare page."""
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    base = str(env.client.base_url)
    root = await sign_in(base, "root@platform.test")

    def in_layout(r: httpx.Response, status: int, signed_in: bool = True) -> None:
        assert r.status_code == status, (r.status_code, r.text[:300])
        assert 'id="error-message"' in r.text and '<link rel="stylesheet"' in r.text
        assert ('<nav aria-label="Main">' in r.text) is signed_in
        assert ("Sign out" in r.text) is signed_in
        assert 'href="/dashboard/"' in r.text  # a way back in any case

    in_layout(await root.get("/no-such-page"), 404)
    in_layout(await root.get(f"/keys/{org.id}/created"), 404)
    bad = await root.get(
        "/invoices?month=nope", headers={"referer": f"{base}/dashboard/invoices?status=draft"}
    )
    in_layout(bad, 400)
    assert '<a href="/dashboard/invoices?status=draft" id="error-back">' in bad.text
    # a referer from another site is not a way back
    other = await root.get("/no-such-page", headers={"referer": "https://elsewhere.example/dashboard/x"})
    assert 'id="error-back"' not in other.text
    # signed out: to the login page, even for a page that does not exist
    anon = httpx.AsyncClient(base_url=base)
    assert (await anon.get("/dashboard/no-such-page")).status_code == 303
    await anon.aclose()

    # 500: logged, and still the layout
    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(limits_pages, "limits_report", broken)
    in_layout(await root.get("/limits"), 500)

    # 403: a suspended organisation's admin keeps the navigation (invoices and usage are open)
    admin = await sign_in(base, "admin@acme.test")
    r = await env.client.post(f"/admin/v1/organizations/{org.id}/suspend", headers=env.root)
    assert r.status_code == 200, r.text
    refused = await admin.get("/keys")
    in_layout(refused, 403)
    assert "suspended" in refused.text
    for client in (root.client, admin.client):
        await client.aclose()
