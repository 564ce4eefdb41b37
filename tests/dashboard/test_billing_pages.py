"""Billing in the dashboard: the invoice PDF (its text read back with poppler's pdftotext),
the platform admins' buttons for rollups, generating and finalizing invoices (the jobs and
services the admin API calls), what organisation admins may not do, and money formatted per
currency. Over HTTP on SQLite and PostgreSQL, and in a real browser (Chromium through
Playwright, against the app served on the test's loop)."""

from __future__ import annotations

import asyncio
import html
import re
import shutil
import subprocess
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from billing.common import grouped, money_text, month_bounds, price_text
from billing.invoices.services import build_invoice_drafts
from billing.ledger.services import record_usage
from billing.prices.services import PriceBook
from billing.rollups.services import store_rollups
from dashboard.filters import invoice_label, money, number, price
from tests.control_plane.conftest import MODEL, AdminEnv
from tests.dashboard.browser import ARTIFACTS, launched, signed_in
from tests.dashboard.conftest import Session, add_user, sign_in
from tokenmill.protocol import UsageRecord

API = "/admin/v1"
# Prices and tokens whose invoice runs into thousands: 123,457 prompt tokens at 20,000 per 1M
# is 2,469.14, 54,321 completion tokens at 30,000 per 1M is 1,629.63.
INPUT, OUTPUT = Decimal("20000"), Decimal("30000")
PROMPT, COMPLETION = 123_457, 54_321
TOTAL = "4,098.77 USD"


def pdf_text(data: bytes) -> str:
    """The text of a PDF as poppler's pdftotext reads it (in reading order, one line a row)."""
    tool = shutil.which("pdftotext")
    if tool is None:
        pytest.fail(
            "no pdftotext: `make test` installs Debian's poppler-utils (apt-get install poppler-utils)"
        )
    assert data.startswith(b"%PDF-"), data[:40]
    done = subprocess.run(
        [tool, "-layout", "-", "-"], input=data, capture_output=True, check=True, timeout=60
    )
    return done.stdout.decode()


def _flash(text: str) -> str:
    found = re.search(r'class="flash (ok|error)"[^>]*>([^<]*)<', text)
    assert found, "no message on the page"
    return f"{found.group(1)}: {html.unescape(found.group(2))}"


async def _follow(s: Session, r: Any) -> str:
    assert r.status_code == 303, (r.status_code, r.text[:1000])
    return (await s.client.get(r.headers["location"], follow_redirects=True)).text


def _months() -> tuple[datetime, datetime]:
    """The start of last month and of this one (UTC)."""
    this = month_bounds(datetime.now(UTC))[0]
    return month_bounds(this - timedelta(days=1))[0], this


async def _tenants(env: AdminEnv) -> tuple[dict[str, str], str]:
    """Organisations acme and other (name -> id), each with an organisation admin and last
    month's usage on the shared deployment (whose id comes second) of one priced model, so
    each gets an invoice of TOTAL; and a platform admin."""
    last, _ = _months()
    out: dict[str, str] = {}
    for name in ("acme", "other"):
        r = await env.client.post(f"{API}/organizations", headers=env.root, json={"name": name})
        assert r.status_code == 201, r.text
        out[name] = r.json()["id"]
        await add_user(env, out[name], f"admin@{name}.test", "org_admin")
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    deps = (await env.client.get(f"{API}/deployments", headers=env.root)).json()
    shared = next(d["id"] for d in deps if d["type"] == "serverless")
    async with env.app.state.sessionmaker() as session, session.begin():
        await PriceBook(session).add_model_price(
            model_ref=MODEL,
            input_per_mtok=INPUT,
            output_per_mtok=OUTPUT,
            effective_from=last - timedelta(days=40),
        )
        await record_usage(
            session,
            [
                UsageRecord(
                    request_id=f"last-{name}",
                    org_id=org_id,
                    model=MODEL,
                    deployment_id=shared,
                    prompt_tokens=PROMPT,
                    completion_tokens=COMPLETION,
                    ts=(last + timedelta(days=2, hours=3)).timestamp(),
                )
                for name, org_id in out.items()
            ],
        )
    return out, shared


async def _invoices(env: AdminEnv, org_id: str) -> list[dict[str, Any]]:
    r = await env.client.get(f"{API}/invoices", headers=env.root, params={"org": org_id})
    assert r.status_code == 200, r.text
    return list(r.json())


async def _drafts(env: AdminEnv) -> None:
    """Last month's drafts, made as the scheduler makes them."""
    last, this = _months()
    async with env.app.state.sessionmaker() as session, session.begin():
        await store_rollups(session, last, this)
        await build_invoice_drafts(session, last)


# --- money -----------------------------------------------------------------------------------


def test_money_is_formatted_per_currency() -> None:
    # invoices: to the cent, thousands separated, with the currency's code
    assert money(Decimal("4098.77"), "usd") == TOTAL
    assert money(Decimal("1234567.891"), "eur") == "1,234,567.89 EUR"
    assert money(Decimal("0.125"), "usd") == "0.12 USD"  # half-even, as invoice lines round
    assert money(Decimal("0"), "usd") == "0.00 USD" and money(Decimal("-0.000"), "usd") == "0.00 USD"
    assert money(None) == "—"
    assert money_text(Decimal("12.5"), "gbp") == "12.50 GBP"
    # usage spend under a cent: up to six decimals, never 0.00
    assert money(Decimal("0.004200000"), "usd") == "0.0042 USD"
    assert money(Decimal("0.000123456"), "usd") == "0.000123 USD"
    assert money(Decimal("0.0000002"), "usd") == "under 0.000001 USD"
    assert money(0.0042, None) == "0.0042"  # a chart's axis: the title names the currency
    assert money(Decimal("0.0099999"), "usd") == "0.01 USD"
    # unit prices: at least to the cent and every decimal they have
    assert price(Decimal("20000.000000000"), "usd") == "20,000.00 USD"
    assert price(Decimal("0.037500000"), "usd") == "0.0375 USD"
    assert price(Decimal("2.5")) == "2.50" and price(None) == "—"
    assert price_text(Decimal("1E+4"), "usd") == "10,000.00 USD"  # never exponent form
    # quantities: exact, thousands separated, no trailing zeros
    assert number(Decimal("1234567.000000")) == "1,234,567" and number(Decimal("3600.5")) == "3,600.5"
    assert number(1234) == "1,234" and grouped(Decimal("-0")) == "0"
    assert invoice_label(None) == "Draft" and invoice_label(7) == "TM-000007"


# --- HTTP ------------------------------------------------------------------------------------


async def test_a_platform_admin_runs_rollups_generates_and_finalizes(admin_env: AdminEnv) -> None:
    env = admin_env
    orgs, shared = await _tenants(env)
    last, this = _months()
    month = f"{last:%Y-%m}"
    s = await sign_in(str(env.client.base_url), "root@platform.test")
    page = (await s.get("/invoices")).text
    assert 'id="billing-runs"' in page and 'action="/dashboard/rollups"' in page
    assert 'action="/dashboard/invoices/generate"' in page

    # rollups of last month; a bad range is a message, not an error page
    said = _flash(
        await _follow(s, await s.post("/rollups", {"from": f"{last:%Y-%m-%d}", "to": f"{this:%Y-%m-%d}"}))
    )
    assert said.startswith(f"ok: Rollups of {last:%Y-%m-%d} 00:00 UTC to {this:%Y-%m-%d} 00:00 UTC: "), said
    assert re.search(r": ([1-9]\d*) rows \(\1 new, 0 changed, 0 removed\)\.$", said), said
    said = _flash(
        await _follow(s, await s.post("/rollups", {"from": f"{this:%Y-%m-%d}", "to": f"{last:%Y-%m-%d}"}))
    )
    assert said == "error: to must be after from.", said

    # generate: two new drafts, then (a rerun) unchanged; a bad month says what is wrong
    said = _flash(await _follow(s, await s.post("/invoices/generate", {"month": month})))
    assert said == f"ok: Invoices of {month}: 2 new.", said
    said = _flash(await _follow(s, await s.post("/invoices/generate", {"month": month})))
    assert said == f"ok: Invoices of {month}: 2 unchanged.", said
    said = _flash(await _follow(s, await s.post("/invoices/generate", {"month": "2026-13"})))
    assert said.startswith("error: month must look like 2026-11"), said

    (draft,) = await _invoices(env, orgs["acme"])
    assert draft["status"] == "draft" and draft["number"] is None
    listed = (await s.get(f"/invoices?month={month}")).text
    row = re.search(rf'<tr data-invoice="{draft["id"]}">(.*?)</tr>', listed, re.S)
    assert row and f"Draft <code>{draft['id']}</code>" in row.group(1), listed
    assert TOTAL in row.group(1) and f"/invoices/{draft['id']}/download/pdf" in row.group(1)
    page = (await s.get(f"/invoices/{draft['id']}")).text
    assert f"Draft invoice <code>{draft['id']}</code>" in page
    assert "20,000.00 USD per 1M tokens" in page and "123,457 tokens" in page
    assert 'id="finalize"' in page and "data-confirm=" in page
    assert 'name="force"' not in page  # last month is over: nothing to force

    # the draft's PDF says so, with its id; no number yet
    r = await s.get(f"/invoices/{draft['id']}/download/pdf")
    assert r.status_code == 200 and r.headers["content-type"] == "application/pdf"
    assert r.headers["content-disposition"] == f'attachment; filename="invoice-{draft["id"]}.pdf"'
    text = pdf_text(r.content)
    assert f"Draft invoice {draft['id']}" in text and "TM-" not in text
    last_day = this - timedelta(days=1)
    assert f"{last:%Y-%m-%d} to {last_day:%Y-%m-%d}" in text and "USD" in text and TOTAL in text

    # finalize: numbered (the first), audited with who did it; a second click is a no-op
    said = _flash(await _follow(s, await s.post(f"/invoices/{draft['id']}/finalize")))
    assert said == f"ok: Finalized invoice {draft['id']} as TM-000001, total {TOTAL}.", said
    page = (await s.get(f"/invoices/{draft['id']}")).text
    assert "<h1>Invoice TM-000001</h1>" in page and 'id="finalize"' not in page
    said = _flash(await _follow(s, await s.post(f"/invoices/{draft['id']}/finalize")))
    assert said == f"ok: Invoice {draft['id']} was already finalized as TM-000001.", said
    (final,) = await _invoices(env, orgs["acme"])
    assert (final["status"], final["number"]) == ("finalized", "TM-000001")
    r = await env.client.get(
        f"{API}/audit", headers=env.root, params={"resource_id": draft["id"], "action": "finalize"}
    )
    (entry,) = r.json()["data"]
    assert entry["actor_user_id"] and entry["before"]["status"] == "draft"

    # its PDF: the number, the total and the currency; the admin API's is the same file
    r = await s.get(f"/invoices/{draft['id']}/download/pdf")
    assert r.headers["content-disposition"] == 'attachment; filename="invoice-TM-000001.pdf"'
    text = pdf_text(r.content)
    for expected in ("Invoice TM-000001", draft["id"], "Finalized", "Currency", TOTAL, "acme"):
        assert expected in text, (expected, text)
    assert re.search(r"Total\s+4,098\.77 USD", text), text
    api = await env.client.get(f"{API}/invoices/{draft['id']}/pdf", headers=env.root)
    assert api.status_code == 200 and api.headers["content-type"] == "application/pdf"
    assert api.content == r.content

    # this month is still running: finalizing it takes the box ticked, and gets the next number
    async with env.app.state.sessionmaker() as session, session.begin():
        await record_usage(
            session,
            [
                UsageRecord(
                    request_id="now",
                    org_id=orgs["acme"],
                    model=MODEL,
                    deployment_id=shared,
                    prompt_tokens=10,
                    ts=time.time(),
                )
            ],
        )
    said = _flash(await _follow(s, await s.post("/rollups", {})))  # default: this month so far
    assert said.startswith(f"ok: Rollups of {this:%Y-%m-%d} 00:00 UTC to "), said
    said = _flash(await _follow(s, await s.post("/invoices/generate", {"month": f"{this:%Y-%m}"})))
    assert said == f"ok: Invoices of {this:%Y-%m}: 1 new.", said
    running = next(i for i in await _invoices(env, orgs["acme"]) if i["status"] == "draft")
    page = (await s.get(f"/invoices/{running['id']}")).text
    assert 'name="force"' in page
    said = _flash(await _follow(s, await s.post(f"/invoices/{running['id']}/finalize")))
    assert said.startswith(f"error: The period of invoice {running['id']} ends "), said
    said = _flash(await _follow(s, await s.post(f"/invoices/{running['id']}/finalize", {"force": "yes"})))
    assert said.startswith(f"ok: Finalized invoice {running['id']} as TM-000002, total "), said
    await s.client.aclose()


async def test_an_org_admin_has_no_billing_buttons_and_cannot_post_them(env: AdminEnv) -> None:
    orgs, _ = await _tenants(env)
    await _drafts(env)
    (own,) = await _invoices(env, orgs["acme"])
    (others,) = await _invoices(env, orgs["other"])
    s = await sign_in(str(env.client.base_url), "admin@acme.test")
    page = (await s.get("/invoices")).text
    assert own["id"] in page and others["id"] not in page
    assert "billing-runs" not in page and "/rollups" not in page and "/invoices/generate" not in page
    page = (await s.get(f"/invoices/{own['id']}")).text
    assert f"Draft invoice <code>{own['id']}</code>" in page and "/finalize" not in page
    # their own invoice's PDF, yes; another organisation's is a 404 like a missing one
    text = pdf_text((await s.get(f"/invoices/{own['id']}/download/pdf")).content)
    assert own["id"] in text and TOTAL in text and orgs["other"] not in text
    assert (await s.get(f"/invoices/{others['id']}/download/pdf")).status_code == 404
    # the forms, posted anyway: 403 (or 404 for another organisation's invoice), nothing done
    last, this = _months()
    for path, data, status in [
        ("/rollups", {"from": f"{last:%Y-%m-%d}", "to": f"{this:%Y-%m-%d}"}, 403),
        ("/invoices/generate", {"month": f"{this:%Y-%m}"}, 403),
        (f"/invoices/{own['id']}/finalize", {}, 403),
        (f"/invoices/{others['id']}/finalize", {}, 404),
        ("/invoices/inv_missing/finalize", {}, 404),
    ]:
        r = await s.post(path, data)
        assert r.status_code == status, (path, r.status_code, r.text[:500])
    for org_id in orgs.values():
        assert [i["status"] for i in await _invoices(env, org_id)] == ["draft"]
    # the admin API's PDF: the same rule for an organisation admin's key
    r = await env.client.post(
        f"{API}/organizations/{orgs['acme']}/keys", headers=env.root, json={"role": "org_admin"}
    )
    acme = {"authorization": f"Bearer {r.json()['secret']}"}
    assert (await env.client.get(f"{API}/invoices/{own['id']}/pdf", headers=acme)).status_code == 200
    assert (await env.client.get(f"{API}/invoices/{others['id']}/pdf", headers=acme)).status_code == 404
    await s.client.aclose()


# --- in a browser ----------------------------------------------------------------------------


async def test_in_a_browser(env: AdminEnv, tmp_path: Path, chromium: str) -> None:
    """A platform admin runs the rollups, generates last month's invoices, finalizes one
    (declining the confirmation once, then accepting it) and downloads its PDF; the
    organisation's admin sees the same invoice without any of the buttons."""
    orgs, _ = await _tenants(env)
    last, this = _months()
    base = str(env.client.base_url)
    await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
    async with launched(chromium) as browser:
        page = await signed_in(browser, base, "root@platform.test")
        await page.get_by_role("navigation", name="Main").get_by_role("link", name="Invoices").click()
        await page.wait_for_url("**/dashboard/invoices")
        runs = page.locator("#billing-runs")
        await runs.get_by_label("From").fill(f"{last:%Y-%m-%d}")
        await runs.get_by_label("To, exclusive").fill(f"{this:%Y-%m-%d}")
        await runs.get_by_role("button", name="Run rollups").click()
        await page.wait_for_selector(".flash.ok")
        assert "Rollups of" in await page.locator(".flash.ok").inner_text()
        await runs.get_by_label("Month", exact=True).fill(f"{last:%Y-%m}")
        await page.get_by_role("button", name="Generate invoices").click()
        await page.wait_for_selector(".flash.ok")
        assert await page.locator(".flash.ok").inner_text() == f"Invoices of {last:%Y-%m}: 2 new."
        (draft,) = await _invoices(env, orgs["acme"])
        row = page.locator(f'#invoices tr[data-invoice="{draft["id"]}"]')
        assert f"Draft {draft['id']}" in await row.inner_text()
        await page.screenshot(path=str(ARTIFACTS / "invoices.png"), full_page=True)
        await row.get_by_role("link", name=f"{last:%Y-%m}").click()
        await page.wait_for_url(f"**/dashboard/invoices/{draft['id']}")
        assert await page.locator("h1").inner_text() == f"Draft invoice {draft['id']}"
        await page.screenshot(path=str(ARTIFACTS / "invoice-draft.png"), full_page=True)

        # declined: nothing posted
        asked: list[str] = []

        async def decline(dialog: Any) -> None:
            asked.append(dialog.message)
            await dialog.dismiss()

        async def accept(dialog: Any) -> None:
            asked.append(dialog.message)
            await dialog.accept()

        page.once("dialog", decline)
        await page.get_by_role("button", name="Finalize invoice").click()
        await page.wait_for_timeout(500)
        assert asked == [
            f"Finalize draft {draft['id']}? It gets the next invoice number and can never change again."
        ]
        assert (await _invoices(env, orgs["acme"]))[0]["status"] == "draft"
        assert await page.locator(".flash").count() == 0
        # accepted: finalized, numbered, said so
        page.once("dialog", accept)
        await page.get_by_role("button", name="Finalize invoice").click()
        await page.wait_for_selector(".flash.ok")
        assert len(asked) == 2
        assert "as TM-000001" in await page.locator(".flash.ok").inner_text()
        assert await page.locator("h1").inner_text() == "Invoice TM-000001"
        assert await page.get_by_role("button", name="Finalize invoice").count() == 0
        await page.screenshot(path=str(ARTIFACTS / "invoice.png"), full_page=True)

        async with page.expect_download() as info:
            await page.get_by_role("link", name="Download PDF").click()
        download = await info.value
        assert download.suggested_filename == "invoice-TM-000001.pdf"
        saved = tmp_path / "invoice.pdf"
        await download.save_as(saved)
        text = pdf_text(await asyncio.to_thread(saved.read_bytes))
        assert "Invoice TM-000001" in text and TOTAL in text and "Currency" in text and "USD" in text

        # on a phone: the forms and a draft's page fit the screen (tables scroll in their box)
        await page.set_viewport_size({"width": 390, "height": 844})
        (other,) = await _invoices(env, orgs["other"])
        for path, name in (
            ("/invoices", "invoices-390"),
            (f"/invoices/{other['id']}", "invoice-draft-390"),
        ):
            await page.goto(f"{base}/dashboard{path}")
            overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, f"{path} is {overflow}px wider than the screen"
            await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        await page.context.close()

        # the organisation's admin: the invoice and its PDF, none of the buttons
        page = await signed_in(browser, base, "admin@acme.test")
        await page.goto(f"{base}/dashboard/invoices")
        assert await page.get_by_role("button", name="Run rollups").count() == 0
        assert await page.get_by_role("button", name="Generate invoices").count() == 0
        own = page.locator(f'#invoices tr[data-invoice="{draft["id"]}"]')
        assert "TM-000001" in await own.inner_text()
        await page.goto(f"{base}/dashboard/invoices/{draft['id']}")
        assert await page.locator("h1").inner_text() == "Invoice TM-000001"
        assert await page.get_by_role("button", name="Finalize invoice").count() == 0
        async with page.expect_download() as info:
            await page.get_by_role("link", name="Download PDF").click()
        await (await info.value).save_as(saved)
        assert "Invoice TM-000001" in pdf_text(await asyncio.to_thread(saved.read_bytes))
        await page.context.close()
