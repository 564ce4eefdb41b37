"""The dashboard in a real browser (issue 8, acceptance 1): Debian's Chromium driven by
Playwright against `tokenmill serve` run as a user runs it (a subprocess, its own
TOKENMILL_HOME, the bundled model on a real worker).

An organisation admin signs in, creates an API key (its secret shown once) and uses it
through the gateway with the openai SDK; the usage page's chart and table then show what
the ledger holds, bucket by bucket; the usage CSV downloads and is the ledger; the key is
revoked in the page, after which the gateway refuses it; a dedicated deployment is created
and scaled; a platform admin sees the shared deployment's live worker. Screenshots go into
test-artifacts/dashboard/ (every page at both widths: test_layout.py, into screens/).
"""

from __future__ import annotations

import csv
import io
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright import sync_api

from tests.dashboard.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.dashboard.conftest import PASSWORD
from tests.e2e.test_admin_journey import MODEL, Server, _stop_process, check, parse_db_time, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DESKTOP = {"width": 1280, "height": 900}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("dashboard"), model_cache)
    try:
        yield s
    finally:
        _stop_process(s.proc)


@pytest.fixture(scope="module")
def tenant(server: Server) -> dict[str, str]:
    """A platform admin user, and an organisation 'acme' with an organisation admin."""
    root = server.admin()
    check(
        root.post(
            f"/organizations/{_default_org(server)}/users",
            json={"email": "ops@tokenmill.test", "password": PASSWORD, "role": "platform_admin"},
        ),
        201,
    )
    org = check(root.post("/organizations", json={"name": "acme"}), 201)
    check(
        root.post(
            f"/organizations/{org['id']}/users",
            json={"email": "admin@acme.test", "password": PASSWORD, "role": "org_admin"},
        ),
        201,
    )
    return {"org_id": org["id"]}


def _default_org(server: Server) -> str:
    return str(server.query("SELECT id FROM organizations WHERE name = 'default'")[0][0])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test` installs Debian's (apt-get install chromium)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)  # emptied once per run: conftest.py
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sign_in(browser: Any, server: Server, email: str, viewport: dict[str, int] = DESKTOP) -> Any:
    context = browser.new_context(viewport=viewport, accept_downloads=True)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.goto(f"{server.url}/dashboard/")  # not signed in: sent to the login page
    assert "/dashboard/login" in page.url
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{server.url}/dashboard/")
    return page


def test_wrong_password_then_sign_in(server: Server, tenant: dict[str, str], browser: Any) -> None:
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(f"{server.url}/dashboard/login")
    shot(page, "login")
    page.get_by_label("Email").fill("admin@acme.test")
    page.get_by_label("Password").fill("not the password")
    page.get_by_role("button", name="Sign in").click()
    assert page.locator("#login-error").inner_text() == "Incorrect email or password."
    shot(page, "login-refused")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{server.url}/dashboard/")
    assert page.get_by_role("heading", level=1).inner_text().startswith("Overview")
    # the session cookie is out of reach of scripts, and only sent to the dashboard
    cookie = next(c for c in context.cookies() if c["name"] == "tm_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax" and cookie["path"] == "/dashboard"
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/dashboard/login")
    page.goto(f"{server.url}/dashboard/keys")
    assert "/dashboard/login" in page.url  # signed out for real
    context.close()


def _ledger(server: Server, org_id: str) -> list[tuple[Any, ...]]:
    return server.query(
        "SELECT request_id, created_at, prompt_tokens, cached_tokens, completion_tokens, status"
        " FROM usage_events WHERE org_id = ? ORDER BY created_at",
        org_id,
    )


def test_key_usage_csv_and_revoke(server: Server, tenant: dict[str, str], browser: Any) -> None:
    org_id = tenant["org_id"]
    page = sign_in(browser, server, "admin@acme.test")
    shot(page, "overview-org-admin")

    # --- create a key: the secret is shown once -------------------------------------------
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name").fill("browser-key")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-secret").input_value()
    assert secret.startswith("tm-") and len(secret) == 51
    shot(page, "key-created")
    page.get_by_role("link", name="Back to the keys").click()
    row = page.locator("#keys tr[data-prefix]", has_text="browser-key")
    assert row.get_attribute("data-status") == "active"
    assert secret not in page.content() and row.get_attribute("data-prefix") == secret[:11]
    shot(page, "keys")

    # --- use it through the gateway ---------------------------------------------------------
    client = server.openai(secret)
    for question in ("Say hi.", "Name a colour.", "Count to three."):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0
        )
        assert reply.choices[0].message.content is not None
    deadline = time.monotonic() + 30
    while len(ledger := _ledger(server, org_id)) < 3:
        assert time.monotonic() < deadline, "the usage never reached the ledger"
        time.sleep(0.2)

    # --- the usage chart and table: the ledger, bucket by bucket ---------------------------
    page.get_by_role("link", name="Usage").click()
    today = datetime.now(UTC).date().isoformat()
    first = parse_db_time(ledger[0][1]).date().isoformat()
    page.get_by_label("From (UTC)").fill(first)
    page.get_by_label("To (UTC, inclusive)").fill(today)
    page.get_by_role("button", name="Apply").click()
    page.wait_for_selector("#usage-table tr[data-bucket]")
    shot(page, "usage")
    ledger = _ledger(server, org_id)
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for _, created, prompt, cached, completion, _ in ledger:
        hour = parse_db_time(created).replace(minute=0, second=0, microsecond=0).isoformat()
        for i, n in enumerate((1, prompt, cached, completion)):
            expected[hour][i] += n
    rows = page.locator("#usage-table tr[data-bucket]")
    shown = {
        rows.nth(i).get_attribute("data-bucket"): [
            int(rows.nth(i).get_attribute(a) or 0)
            for a in ("data-requests", "data-prompt", "data-cached", "data-completion")
        ]
        for i in range(rows.count())
    }
    assert shown == dict(expected)
    # the chart's bars carry the same numbers (every hour of the range, empty ones as 0)
    bars = page.locator("svg#usage-requests rect.mark")
    plotted = {
        bars.nth(i).get_attribute("data-bucket"): bars.nth(i).get_attribute("data-value")
        for i in range(bars.count())
    }
    assert {k: float(v or 0) for k, v in plotted.items() if float(v or 0)} == {
        k: float(v[0]) for k, v in expected.items()
    }
    tokens = page.locator("svg#usage-tokens rect.mark")
    assert sum(float(tokens.nth(i).get_attribute("data-value") or 0) for i in range(tokens.count())) == sum(
        v[1] + v[3] for v in expected.values()
    )

    # --- the CSV download is the ledger ---------------------------------------------------
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    path = download.value.path()
    assert path is not None
    exported = list(csv.DictReader(io.StringIO(Path(path).read_text())))
    shutil.copy(path, ARTIFACTS / "usage.csv")
    assert [e["request_id"] for e in exported] == [r[0] for r in ledger]
    assert [(int(e["prompt_tokens"]), int(e["completion_tokens"])) for e in exported] == [
        (r[2], r[4]) for r in ledger
    ]
    assert {e["org_id"] for e in exported} == {org_id}

    # --- revoke it in the page: the gateway refuses it ------------------------------------
    page.get_by_role("link", name="API keys").click()
    page.once("dialog", lambda dialog: dialog.accept())  # "Revoke key ...?" (test_keys_flow.py)
    page.locator("#keys tr[data-prefix]", has_text="browser-key").get_by_role("button", name="Revoke").click()
    assert "Revoked key" in page.locator(".flash.ok").inner_text()
    assert page.locator("#keys tr", has_text="browser-key").get_attribute("data-status") == "revoked"
    shot(page, "key-revoked")
    deadline = time.monotonic() + 5
    with pytest.raises(openai.AuthenticationError):
        while time.monotonic() < deadline:
            client.models.list()
            time.sleep(0.1)
    page.context.close()


def test_create_and_scale_a_dedicated_deployment(
    server: Server, tenant: dict[str, str], browser: Any
) -> None:
    # a dedicated deployment's GPU type must be in the price book
    check(server.admin().post("/prices/gpus", json={"gpu_type": "cpu-test", "per_hour": "0.10"}), 201)
    page = sign_in(browser, server, "admin@acme.test")
    page.get_by_role("link", name="Deployments").click()
    form = page.locator("#new-deployment")
    form.get_by_label("Name", exact=True).fill("acme-reserved")
    form.get_by_label("Base model").select_option(label=MODEL)
    form.get_by_label("GPU type").fill("cpu-test")
    # scaled to zero: no worker starts for it during the test
    form.get_by_label("Minimum replicas").fill("0")
    form.get_by_label("Maximum replicas").fill("1")
    form.get_by_role("button", name="Create deployment").click()
    page.wait_for_url("**/dashboard/deployments/dep_*")
    assert page.get_by_role("heading", level=1).inner_text() == "acme-reserved"
    shot(page, "deployment-created")
    dep_id = page.url.rsplit("/", 1)[1]
    page.get_by_label("Maximum replicas").fill("2")
    page.get_by_role("button", name="Save").click()
    assert page.locator("#replicas").inner_text() == "0 to 2"
    shot(page, "deployment-scaled")
    listed = check(server.admin().get(f"/deployments/{dep_id}"))
    assert (listed["org_id"], listed["type"], listed["min_replicas"], listed["max_replicas"]) == (
        tenant["org_id"],
        "dedicated",
        0,
        2,
    )
    page.context.close()


def test_live_workers_and_the_keyboard(server: Server, tenant: dict[str, str], browser: Any) -> None:
    """The shared deployment's real worker on its page; the skip link. (Every page at both
    widths, with screenshots and the clipping checks: tests/dashboard/test_layout.py.)"""
    page = sign_in(browser, server, "ops@tokenmill.test")
    serving = check(server.admin().get("/deployments"))
    shared = next(d for d in serving if d["type"] == "serverless")
    # the shared deployment's live worker, with its KV usage and queue depth
    page.goto(f"{server.url}/dashboard/deployments/{shared['id']}")
    page.wait_for_selector("#workers-table tr[data-worker]")
    worker = page.locator("#workers-table tr[data-worker]").first
    assert 0.0 <= float(worker.get_attribute("data-kv") or -1) <= 1.0
    assert int(worker.get_attribute("data-waiting") or -1) >= 0
    shot(page, "deployment-live-worker")
    # keyboard: the skip link is the first stop and lands on the content
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.context.close()
