"""API keys in the dashboard: a new (or rotated) key's secret is shown by post/redirect/get,
once (a reload makes no second key and shows the secret no more, another organisation's
admin gets a 404), and revoke, rotate and the other destructive buttons ask first. Over
HTTP on SQLite and PostgreSQL, and in Chromium."""

from __future__ import annotations

import re
from typing import Any

from playwright.async_api import Page

from tests.control_plane.conftest import AdminEnv
from tests.dashboard.browser import ARTIFACTS, answer_dialogs, launched, signed_in
from tests.dashboard.conftest import add_user, sign_in

API = "/admin/v1"
_SECRET = re.compile(r'id="new-secret"[^>]*>(tm-[A-Za-z0-9]+)<')


async def _keys(env: AdminEnv, org_id: str) -> list[dict[str, Any]]:
    r = await env.client.get(f"{API}/organizations/{org_id}/keys", headers=env.root)
    assert r.status_code == 200, r.text
    return list(r.json())


async def test_the_secret_page_shows_it_once_and_only_to_its_organisation(admin_env: AdminEnv) -> None:
    env = admin_env
    acme, other = await env.org("acme"), await env.org("other")
    await add_user(env, acme.id, "admin@acme.test", "org_admin")
    await add_user(env, other.id, "admin@other.test", "org_admin")
    base = str(env.client.base_url)
    s, o = await sign_in(base, "admin@acme.test"), await sign_in(base, "admin@other.test")
    r = await s.post("/keys", {"org": acme.id, "name": "app"})
    assert r.status_code == 303
    (made,) = [k for k in await _keys(env, acme.id) if k["name"] == "app"]
    assert r.headers["location"] == f"/dashboard/keys/{made['id']}/created"
    page = r.headers["location"].removeprefix("/dashboard")
    # another organisation's admin: a 404, and the secret still waits for its owner
    assert (await o.get(page)).status_code == 404
    shown = await s.get(page)
    secret = _SECRET.search(shown.text)
    assert shown.status_code == 200 and secret and secret.group(1).startswith(made["prefix"])
    assert "no-store" in shown.headers["cache-control"]
    models = await env.client.get("/v1/models", headers={"authorization": f"Bearer {secret.group(1)}"})
    assert models.status_code == 200
    again = await s.get(page)
    assert again.status_code == 200 and secret.group(1) not in again.text and "shown once" in again.text
    # rotating lands on the same kind of page, for the new key
    r = await s.post(f"/keys/{made['id']}/rotate")
    assert r.status_code == 303
    rotated = [k for k in await _keys(env, acme.id) if k["name"] == "app" and k["revoked_at"] is None]
    assert [k["id"] for k in rotated] != [made["id"]] and len(rotated) == 1
    assert r.headers["location"] == f"/dashboard/keys/{rotated[0]['id']}/created"
    new = _SECRET.search((await s.get(r.headers["location"].removeprefix("/dashboard"))).text)
    assert new and new.group(1) != secret.group(1)
    await s.client.aclose()
    await o.client.aclose()


async def test_destructive_buttons_ask_first(env: AdminEnv) -> None:
    """Revoke and rotate (not the primary button), suspend, disable and delete carry the
    confirmation the page's script asks before posting."""
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    await add_user(env, org.id, "dev@acme.test", "org_admin")
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    s = await sign_in(str(env.client.base_url), "root@platform.test")
    keys = (await s.get(f"/keys?org={org.id}")).text
    assert re.search(r'/revoke" class="inline" data-confirm="Revoke key ', keys)
    assert re.search(r'/rotate" class="inline" data-confirm="Rotate key ', keys)
    assert re.search(r'<button type="submit" class="secondary">Rotate', keys)
    page = (await s.get(f"/orgs/{org.id}")).text
    assert 'data-confirm="Suspend acme?' in page
    assert 'data-confirm="Disable dev@acme.test?' in page
    await s.client.aclose()


async def _create(page: Page, base: str, name: str) -> str:
    await page.goto(f"{base}/dashboard/keys")
    form = page.locator("#new-key")
    await form.get_by_label("Name").fill(name)
    await form.get_by_role("button", name="Create key").click()
    await page.wait_for_url("**/dashboard/keys/*/created")
    return await page.locator("#new-secret").input_value()


async def test_in_a_browser_a_reload_makes_no_second_key_and_revoke_asks(
    env: AdminEnv,
    chromium: str,
) -> None:
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    before = await _keys(env, org.id)
    base = str(env.client.base_url)
    async with launched(chromium) as browser:
        page = await signed_in(browser, base, "admin@acme.test")
        secret = await _create(page, base, "reload-me")
        assert secret.startswith("tm-")
        await page.screenshot(path=str(ARTIFACTS / "key-created.png"), full_page=True)
        after = await _keys(env, org.id)
        (made,) = [k for k in after if k["id"] not in {b["id"] for b in before}]
        assert made["name"] == "reload-me" and secret.startswith(made["prefix"])

        # the reload: no second key, no secret
        response = await page.reload()
        assert response is not None and response.status == 200
        assert await page.locator("#new-secret").count() == 0
        assert secret not in await page.content()
        assert "shown once" in await page.locator("#secret-gone").inner_text()
        assert len(await _keys(env, org.id)) == len(before) + 1
        await page.screenshot(path=str(ARTIFACTS / "key-created-reloaded.png"), full_page=True)

        # revoke asks; dismissed, the key stays active
        await page.get_by_role("link", name="Back to the keys").click()
        row = page.locator(f'#keys tr[data-key="{made["id"]}"]')
        asked: list[str] = []
        answer_dialogs(page, False, asked)
        await row.get_by_role("button", name="Revoke").click()
        await page.wait_for_timeout(500)
        assert asked == [
            f"Revoke key reload-me ({made['prefix']}…)? Requests using it are refused from now on; "
            "this cannot be undone."
        ]
        assert await row.get_attribute("data-status") == "active"
        assert await page.locator(".flash").count() == 0
        (still,) = [k for k in await _keys(env, org.id) if k["id"] == made["id"]]
        assert still["revoked_at"] is None
        # accepted: revoked
        answer_dialogs(page, True, asked)
        await row.get_by_role("button", name="Revoke").click()
        await page.wait_for_selector(".flash.ok")
        assert len(asked) == 2
        assert "Revoked key" in await page.locator(".flash.ok").inner_text()
        assert (
            await page.locator(f'#keys tr[data-key="{made["id"]}"]').get_attribute("data-status") == "revoked"
        )
        (gone,) = [k for k in await _keys(env, org.id) if k["id"] == made["id"]]
        assert gone["revoked_at"] is not None

        # rotate asks too, then shows the new secret once
        await _create(page, base, "rotate-me")
        await page.get_by_role("link", name="Back to the keys").click()
        answer_dialogs(page, True, asked)
        await (
            page.locator("#keys tr[data-status=active]", has_text="rotate-me")
            .get_by_role("button", name="Rotate")
            .click()
        )
        await page.wait_for_url("**/dashboard/keys/*/created")
        assert asked[-1].startswith("Rotate key rotate-me (")
        assert (await page.locator("h1").inner_text()) == "API key rotated"
        await page.reload()
        assert await page.locator("#new-secret").count() == 0
        await page.context.close()
