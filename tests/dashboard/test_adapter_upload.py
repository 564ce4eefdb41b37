"""The adapter upload form in Chromium: with JavaScript on (the page's script sends it by XHR
with a progress bar) a refused adapter's reason shows next to the form and what was typed
stays; an accepted one leads to the page with its message and row. With JavaScript off the
form posts and redirects as before."""

from __future__ import annotations

from typing import Any

from playwright.async_api import Page, expect

from tests.control_plane.conftest import MODEL, AdminEnv, lora_files
from tests.dashboard.browser import ARTIFACTS, launched, signed_in
from tests.dashboard.conftest import add_user

API = "/admin/v1"


def _file(name: str, data: bytes) -> dict[str, Any]:
    return {"name": name, "mimeType": "application/octet-stream", "buffer": data}


async def _fill(page: Page, name: str, files: dict[str, bytes]) -> None:
    form = page.locator("#upload")
    await form.get_by_label("Name").fill(name)
    await form.get_by_label("Base model").select_option(label=MODEL)
    await form.get_by_label("adapter_config.json").set_input_files(
        _file("adapter_config.json", files["adapter_config.json"])
    )
    await form.get_by_label("adapter_model.safetensors").set_input_files(
        _file("adapter_model.safetensors", files["adapter_model.safetensors"])
    )


async def _refusal(env: AdminEnv, org_id: str, files: dict[str, bytes]) -> str:
    """What the admin API says of the same files: the reason the page must show."""
    r = await env.client.post(
        f"{API}/organizations/{org_id}/adapters",
        headers=env.root,
        data={"name": "probe", "model": MODEL},
        files=[("file", (n, b, "application/octet-stream")) for n, b in files.items()],
    )
    assert r.status_code == 400, r.text
    return str(r.json()["error"]["message"])


async def _adapters(env: AdminEnv, org_id: str) -> list[str]:
    r = await env.client.get(f"{API}/organizations/{org_id}/adapters", headers=env.root)
    return [a["name"] for a in r.json()]


async def test_a_refused_upload_says_why_next_to_the_form_and_keeps_the_name(
    env: AdminEnv,
    chromium: str,
) -> None:
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    # the config says rank 8, the weights are rank 4; and weights of the wrong shape
    mismatched = lora_files(rank=4, config={"r": 8})
    wrong_shape = lora_files(rank=4, shapes={"q_proj": (100, 576)})
    reasons = [await _refusal(env, org.id, mismatched), await _refusal(env, org.id, wrong_shape)]
    assert reasons[0] != reasons[1]
    base = str(env.client.base_url)
    async with launched(chromium) as browser:
        page = await signed_in(browser, base, "admin@acme.test")
        await page.goto(f"{base}/dashboard/models")
        outcome = page.locator("#upload-outcome")
        assert await outcome.get_attribute("role") == "alert"  # read out when it changes
        for files, reason in zip((mismatched, wrong_shape), reasons, strict=True):
            await _fill(page, "support-bot", files)
            await page.locator("#upload").get_by_role("button", name="Upload").click()
            await expect(outcome).to_have_text(reason)  # (the page's CSP allows no eval'd waits)
            assert await page.locator("#adapter-name").input_value() == "support-bot"
            assert await page.locator("#upload").get_by_role("button", name="Upload").is_enabled()
            assert await page.locator(".flash").count() == 0
            # nothing was kept, and the message was not left for the next page either
            assert await _adapters(env, org.id) == []
        await page.screenshot(path=str(ARTIFACTS / "upload-refused.png"), full_page=True)
        await page.reload()
        assert await page.locator(".flash").count() == 0

        # a valid one: the page comes back with the message and the new row
        await _fill(page, "support-bot", lora_files())
        await page.locator("#upload").get_by_role("button", name="Upload").click()
        await page.wait_for_selector(".flash.ok")
        assert await page.locator(".flash.ok").inner_text() == (
            "Uploaded adapter support-bot (rank 4); use it as the model name."
        )
        assert await page.locator("#adapters tr[data-adapter]", has_text="support-bot").count() == 1
        assert await page.locator("#upload-outcome").inner_text() == ""
        assert await _adapters(env, org.id) == ["support-bot"]
        await page.screenshot(path=str(ARTIFACTS / "upload-accepted.png"), full_page=True)
        await page.context.close()


async def test_without_javascript_the_form_posts_and_redirects(
    env: AdminEnv,
    chromium: str,
) -> None:
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    mismatched = lora_files(rank=4, config={"r": 8})
    reason = await _refusal(env, org.id, mismatched)
    base = str(env.client.base_url)
    async with launched(chromium) as browser:
        page = await signed_in(browser, base, "admin@acme.test", java_script_enabled=False)
        await page.goto(f"{base}/dashboard/models")
        await _fill(page, "plain-form", mismatched)
        await page.locator("#upload").get_by_role("button", name="Upload").click()
        await page.wait_for_selector(".flash.error")
        assert await page.locator(".flash.error").inner_text() == reason
        assert await _adapters(env, org.id) == []
        await _fill(page, "plain-form", lora_files())
        await page.locator("#upload").get_by_role("button", name="Upload").click()
        await page.wait_for_selector(".flash.ok")
        assert "Uploaded adapter plain-form" in await page.locator(".flash.ok").inner_text()
        assert await _adapters(env, org.id) == ["plain-form"]
        await page.context.close()
