"""Refused requests and keys' last use on the dashboard (issue 20, acceptance 4): the error
rate counts refused requests with failed ones (usage series on SQLite and PostgreSQL), and
in a real browser (Chromium through Playwright, against the app served on the test's loop)
an organisation admin sees a key's "Last used" within seconds of its use, and the overview's
error rate and refusals after a few refused requests."""

from __future__ import annotations

import asyncio
import csv
import io
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from playwright.async_api import async_playwright
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger.services import UsageFilter
from billing.refusals.services import add_refusals
from dashboard.services import usage_series, window
from tests.billing.billing_world import add_usage
from tests.control_plane.conftest import AdminEnv, make_admin_env
from tests.dashboard.browser import ARTIFACTS, CHROMIUM_ARGS
from tests.dashboard.conftest import PASSWORD, add_user


def _event(n: int, org: str, key: str, at: datetime, status: str = "ok") -> dict[str, object]:
    return {
        "request_id": f"req-{n}",
        "org_id": org,
        "api_key_id": key,
        "model": "m",
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 2,
        "status": status,
        "created_at": at,
    }


async def test_error_rate_counts_refused_requests(migrated_db: async_sessionmaker[AsyncSession]) -> None:
    now = datetime(2026, 3, 4, 12, 30, tzinfo=UTC)
    hour = now.replace(minute=0)
    # Org A, this hour: 6 answered (1 failed, 1 cancelled: not an error), 4 refused by key 1,
    # 2 by key 2; an hour earlier, 2 answered. Org B: 10 refused, nothing answered.
    events = [_event(i, "org_a", "key_1", hour + timedelta(minutes=i)) for i in range(4)]
    events += [
        _event(4, "org_a", "key_1", hour + timedelta(minutes=5), "error"),
        _event(5, "org_a", "key_2", hour + timedelta(minutes=6), "cancelled"),
        _event(6, "org_a", "key_1", hour - timedelta(minutes=30)),
        _event(7, "org_a", "key_1", hour - timedelta(minutes=20)),
    ]
    await add_usage(migrated_db, events)
    async with migrated_db() as s, s.begin():
        await add_refusals(
            s,
            {
                ("org_a", "key_1", "rate_limit_requests", hour + timedelta(minutes=1)): 3,
                ("org_a", "key_1", "not_found", hour + timedelta(minutes=2)): 1,
                ("org_a", "key_2", "budget", hour + timedelta(minutes=2)): 2,
                ("org_b", "key_3", "auth", hour + timedelta(minutes=3)): 10,
            },
        )
    win = window("24h", now=now)
    async with migrated_db() as s:
        series = await usage_series(s, win, UsageFilter(org_id="org_a"))
        this, before = series.buckets[-1], series.buckets[-2]
        assert (this.requests, this.errors, this.refused) == (6, 1, 6)
        assert this.error_rate == pytest.approx(7 / 12)
        assert (before.requests, before.refused, before.error_rate) == (2, 0, 0.0)
        assert (series.totals.requests, series.totals.refused) == (8, 6)
        assert series.totals.error_rate == pytest.approx(7 / 14)
        assert series.refused_by_reason == {"rate_limit_requests": 3, "budget": 2, "not_found": 1}

        one_key = await usage_series(s, win, UsageFilter(org_id="org_a", key_id="key_2"))
        assert (one_key.totals.requests, one_key.totals.errors, one_key.totals.refused) == (1, 0, 2)
        assert one_key.refused_by_reason == {"budget": 2}

        only_refused = await usage_series(s, win, UsageFilter(org_id="org_b"))
        assert only_refused.totals.error_rate == 1.0 and only_refused.totals.refused == 10

        everyone = await usage_series(s, win, UsageFilter())
        assert everyone.totals.refused == 16

        # Refusals are per key, not per model name: with a model filter they are not known.
        by_model = await usage_series(s, win, UsageFilter(org_id="org_a", model="m"))
        assert not by_model.refusals_known and by_model.totals.refused == 0
        assert by_model.totals.error_rate == pytest.approx(1 / 8)


@pytest.fixture
async def quick_env(tmp_path: Path, model_cache: Path, sqlite_url: str) -> AsyncIterator[AdminEnv]:
    """The app with the refusal counts and keys' last use written every 0.2 s."""
    async with make_admin_env(
        tmp_path, model_cache, sqlite_url, refusals_flush_seconds=0.2, key_last_used_seconds=0.2
    ) as env:
        yield env


async def test_in_a_browser(quick_env: AdminEnv, chromium: str, tmp_path: Path) -> None:
    env = quick_env
    org = await env.org("acme")
    await add_user(env, org.id, "admin@acme.test", "org_admin")
    key = await env.member_key(org.id, name="backend")
    used = {"authorization": f"Bearer {key['secret']}"}
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    before = datetime.now(UTC).replace(second=0, microsecond=0)
    for _ in range(3):  # accepted keys, refused requests: the key was used, and refused
        r = await env.client.post("/v1/chat/completions", headers=used, json=body)
        assert r.status_code == 404, r.text
    made_up = {"authorization": "Bearer tm-madeup0000000000000000000000000000"}
    assert (await env.client.get("/v1/models", headers=made_up)).status_code == 401  # nobody's

    base = str(env.client.base_url)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(accept_downloads=True)
            context.set_default_timeout(30_000)
            page = await context.new_page()
            await page.goto(f"{base}/dashboard/login")
            await page.get_by_label("Email").fill("admin@acme.test")
            await page.get_by_label("Password").fill(PASSWORD)
            await page.get_by_role("button", name="Sign in").click()
            await page.wait_for_url(f"{base}/dashboard/")

            # "Last used": written by the gateway within its interval (0.2 s here, 30 s by
            # default), so at the latest a reload or two later.
            last_used = page.locator(f'#keys tr[data-key="{key["id"]}"] td').nth(6)
            shown = "—"
            for _ in range(50):
                await page.goto(f"{base}/dashboard/keys?org={org.id}")
                shown = (await last_used.inner_text()).strip()
                if shown != "—":
                    break
                await asyncio.sleep(0.2)
            header = await page.locator("#keys thead th").nth(7).inner_text()
            assert header == "Last used"
            found = re.fullmatch(r"(\d{4}-\d\d-\d\d \d\d:\d\d) UTC", shown)
            assert found, shown
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M").replace(tzinfo=UTC)
            assert before <= at <= datetime.now(UTC)
            await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "keys-last-used.png"), full_page=True)

            # The overview: three refused requests, none answered.
            refused = "0"
            for _ in range(50):
                await page.goto(f"{base}/dashboard/")
                refused = await page.locator("#total-refused").inner_text()
                if refused != "0":
                    break
                await asyncio.sleep(0.2)
            assert refused == "3"
            assert await page.locator("#total-errors").inner_text() == "100.0%"
            await page.screenshot(path=str(ARTIFACTS / "overview-refusals.png"), full_page=True)

            await page.get_by_role("navigation", name="Main").get_by_role("link", name="Usage").click()
            await page.wait_for_url("**/dashboard/usage**")
            assert await page.locator("#usage-refused").inner_text() == "3"
            assert (
                await page.locator('#refused-by-reason [data-reason="not_found"]').inner_text()
                == "not found 3"
            )
            row = page.locator("#usage-table tr[data-bucket]")
            assert await row.count() == 1 and await row.get_attribute("data-refused") == "3"
            async with page.expect_download() as info:
                await page.locator("#refusals-csv").click()
            saved = tmp_path / "refusals.csv"
            await (await info.value).save_as(saved)
            rows = list(csv.DictReader(io.StringIO(await asyncio.to_thread(saved.read_text))))
            assert [(x["org_id"], x["api_key_id"], x["reason"]) for x in rows] == [
                (org.id, key["id"], "not_found")
            ]
            assert sum(int(x["count"]) for x in rows) == 3
            await context.close()
        finally:
            await browser.close()
