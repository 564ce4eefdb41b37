"""Chromium (Debian's, driven by Playwright) against the app the `env`/`admin_env` fixtures
serve on the test's loop: launching it and signing in through the login form, as a user does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from playwright.async_api import Browser, Dialog, Page, async_playwright

from tests.dashboard.conftest import PASSWORD
from tests.dashboard.test_batches_page import CHROMIUM_ARGS

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


@asynccontextmanager
async def launched(chromium: str) -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def signed_in(
    browser: Browser, base: str, email: str, viewport: dict[str, int] = DESKTOP, **options: Any
) -> Page:
    """A new browser context signed in as `email` (`options`: the context's, such as
    java_script_enabled=False), on the overview."""
    context = await browser.new_context(viewport=viewport, accept_downloads=True, **options)  # type: ignore[arg-type]
    context.set_default_timeout(30_000)
    page = await context.new_page()
    await page.goto(f"{base}/dashboard/login")
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{base}/dashboard/")
    return page


def answer_dialogs(page: Page, accept: bool, asked: list[str]) -> None:
    """The next confirmation dialog is answered (`accept` or dismiss); its message is kept."""

    async def answer(dialog: Dialog) -> None:
        asked.append(dialog.message)
        await (dialog.accept() if accept else dialog.dismiss())

    page.once("dialog", answer)
