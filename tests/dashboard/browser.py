"""Chromium (Debian's, driven by Playwright) against the app the `env`/`admin_env` fixtures
serve on the test's loop: launching it and signing in through the login form, as a user does."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, Dialog, Page, async_playwright

from tests.dashboard.conftest import PASSWORD

# Every browser test's screenshots go here (README: Dashboard).
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM", "/usr/bin/chromium")
# Without these, Chromium stalls on a closed network (updates, sync, QUIC probes).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
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
