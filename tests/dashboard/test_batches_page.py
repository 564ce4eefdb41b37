"""The batches page: an organisation's `/v1/batches` jobs, made here through the control
plane's BatchService as the gateway and the batch runner make them (an input file, validation,
lines' results, finalizing), then seen, downloaded and cancelled in the dashboard, over HTTP
on SQLite and PostgreSQL and once in a real browser (Chromium through Playwright, against the
app served on the test's loop)."""

from __future__ import annotations

import asyncio
import html
import io
import json
import re
from pathlib import Path
from typing import Any

from playwright.async_api import async_playwright
from sqlalchemy import select, update

from control_plane.audit.models import AuditEntry
from control_plane.batches.lines import result_line
from control_plane.batches.models import Batch
from control_plane.batches.services import BatchService, batch_service
from dashboard.batch_pages import PAGE_SIZE
from tests.control_plane.conftest import MODEL, AdminEnv
from tests.dashboard.browser import ARTIFACTS, CHROMIUM_ARGS, answer_dialogs
from tests.dashboard.conftest import PASSWORD, Session, add_user, sign_in
from tokenmill.openai_batches import BatchCreateRequest

ENDPOINT = "/v1/chat/completions"
_ROW = re.compile(
    r'<tr data-batch="([^"]+)" data-status="([^"]+)" data-total="(\d+)" '
    r'data-completed="(\d+)" data-failed="(\d+)">(.*?)</tr>',
    re.S,
)


def _service(env: AdminEnv) -> BatchService:
    """One like the gateway's and the runner's: the app's database and file storage."""
    return batch_service(env.settings, env.app.state.sessionmaker, env.storage)


def _line(custom_id: str, url: str = ENDPOINT) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": custom_id}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


async def _batch(
    service: BatchService,
    org_id: str,
    *,
    valid: int = 3,
    invalid: int = 0,
    ran: tuple[tuple[int, bool], ...] = (),
    end: str | None = None,
) -> Batch:
    """A batch of `valid` good lines then `invalid` bad ones (failed at validation), with the
    results of the lines `ran` (line number, ok) recorded, and ended as `end` if given."""
    lines = [_line(f"ok-{i}") for i in range(valid)] + [
        _line(f"bad-{i}", url="/v1/embeddings") for i in range(invalid)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    source = await service.files.upload(
        org_id, filename="requests.jsonl", purpose="batch", content=io.BytesIO(content)
    )
    request = BatchCreateRequest(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
    batch = await service.validate(await service.create(org_id, None, request))
    assert batch.status == "in_progress", batch.errors
    for number, ok in ran:
        custom_id = lines[number - 1]["custom_id"]
        body = {"id": f"chatcmpl-{number}"} if ok else {"error": {"message": "boom"}}
        result = result_line(batch.id, number, custom_id, status=200 if ok else 500, body=body)
        assert await service.record(batch.id, number, ok=ok, result=result)
    if end is not None:
        await service.finalize(await service.get(org_id, batch.id), end)
    return await service.get(org_id, batch.id)


async def _bytes(service: BatchService, org_id: str, file_id: str) -> bytes:
    row = await service.files.get(org_id, file_id)
    return b"".join([chunk async for chunk in await service.files.open(row)])


def _rows(text: str) -> dict[str, dict[str, Any]]:
    """The batches table's rows by batch id, in page order."""
    return {
        m.group(1): {
            "status": m.group(2),
            "counts": (int(m.group(3)), int(m.group(4)), int(m.group(5))),
            "html": m.group(6),
        }
        for m in _ROW.finditer(text)
    }


def _flash(text: str) -> str:
    found = re.search(r'class="flash (ok|error)"[^>]*>([^<]*)<', text)
    assert found, "no message on the page"
    return f"{found.group(1)}: {html.unescape(found.group(2))}"


async def _follow(s: Session, r: Any) -> str:
    assert r.status_code == 303, r.text[:1000]
    return (await s.client.get(r.headers["location"], follow_redirects=True)).text


async def _admin_of(env: AdminEnv, name: str) -> tuple[str, Session]:
    """A new organisation and its signed-in organisation admin."""
    org = await env.org(name)
    await add_user(env, org.id, f"admin@{name}.test", "org_admin")
    return org.id, await sign_in(str(env.client.base_url), f"admin@{name}.test")


async def test_the_page_lists_batches_with_their_progress_and_serves_their_files(
    admin_env: AdminEnv,
) -> None:
    env, service = admin_env, _service(admin_env)
    org_id, s = await _admin_of(env, "alpha")
    running = await _batch(service, org_id, valid=3, invalid=1, ran=((1, True), (2, False)))
    done = await _batch(service, org_id, valid=2, invalid=1, ran=((1, True), (2, True)), end="completed")
    assert (running.total, running.completed, running.failed) == (4, 1, 2)
    assert (done.status, done.total, done.completed, done.failed) == ("completed", 3, 2, 1)
    assert done.output_file_id and done.error_file_id

    r = await s.get("/batches")
    assert r.status_code == 200, r.text[:1000]
    assert 'aria-current="page">Batches<' in r.text  # in the navigation, as the current page
    rows = _rows(r.text)
    assert list(rows) == sorted([running.id, done.id], reverse=True)  # newest first
    assert rows[running.id]["status"] == "in_progress" and rows[running.id]["counts"] == (4, 1, 2)
    assert rows[done.id]["status"] == "completed" and rows[done.id]["counts"] == (3, 2, 1)
    cells = rows[running.id]["html"]
    assert '<progress max="4" value="3"' in cells and "75%" in cells and "3 of 4, 2 failed" in cells
    assert MODEL in cells and ENDPOINT in cells
    assert '<progress max="3" value="3"' in rows[done.id]["html"] and "100%" in rows[done.id]["html"]
    # cancel only what may still be cancelled; output and errors only once they exist
    assert f"/batches/{running.id}/cancel" in cells and "/download/output" not in cells
    assert f"/batches/{done.id}/cancel" not in rows[done.id]["html"]
    assert f"/batches/{done.id}/download/output?org={org_id}" in rows[done.id]["html"]
    assert f"/batches/{done.id}/download/errors?org={org_id}" in rows[done.id]["html"]

    # the downloads are the stored files' bytes, as attachments named as /v1/files names them
    output = await s.get(f"/batches/{done.id}/download/output?org={org_id}")
    assert output.status_code == 200
    assert output.content == await _bytes(service, org_id, done.output_file_id)
    assert [json.loads(x)["custom_id"] for x in output.text.splitlines()] == ["ok-0", "ok-1"]
    assert output.headers["content-disposition"] == f"attachment; filename*=UTF-8''{done.id}_output.jsonl"
    errors = await s.get(f"/batches/{done.id}/download/errors")  # the admin's own organisation
    assert errors.status_code == 200
    assert errors.content == await _bytes(service, org_id, done.error_file_id)
    (error,) = [json.loads(x) for x in errors.text.splitlines()]
    assert (error["custom_id"], error["error"]["code"]) == ("bad-0", "mismatched_endpoint")
    source = await s.get(f"/batches/{done.id}/download/input?org={org_id}")
    assert source.status_code == 200
    assert [json.loads(x)["custom_id"] for x in source.text.splitlines()] == ["ok-0", "ok-1", "bad-0"]
    # no such file (yet), no such kind, no such batch: 404 pages
    for path in (
        f"/batches/{running.id}/download/output",
        f"/batches/{done.id}/download/secrets",
        "/batches/batch_000000000000000000000000/download/output",
    ):
        r = await s.get(path)
        assert r.status_code == 404 and "<h1" in r.text, path
    await s.client.aclose()


async def test_another_organisation_sees_nothing_and_cannot_download_or_cancel(
    admin_env: AdminEnv,
) -> None:
    env, service = admin_env, _service(admin_env)
    alpha, a = await _admin_of(env, "alpha")
    bravo, b = await _admin_of(env, "bravo")
    theirs = await _batch(service, alpha, valid=2, invalid=1, ran=((1, True),))
    ended = await _batch(service, alpha, valid=1, invalid=1, ran=((1, True),), end="completed")
    mine = await _batch(service, bravo, valid=1)
    assert ended.output_file_id and ended.error_file_id

    listing = (await b.get("/batches")).text
    assert list(_rows(listing)) == [mine.id]
    assert theirs.id not in listing and ended.id not in listing and "alpha" not in listing
    for path in (
        f"/batches?org={alpha}",
        f"/batches/{ended.id}/download/output",
        f"/batches/{ended.id}/download/errors",
        f"/batches/{ended.id}/download/input",
        f"/batches/{ended.id}/download/output?org={alpha}",
        f"/batches/{ended.id}/download/output?org={bravo}",
    ):
        r = await b.get(path)
        assert r.status_code == 404, (path, r.status_code)
        assert ended.output_file_id not in r.text
    for org in (alpha, bravo):
        r = await b.post(f"/batches/{theirs.id}/cancel", {"org": org})
        assert r.status_code == 404, (org, r.status_code)
    assert (await service.get(alpha, theirs.id)).status == "in_progress"

    # a batch naming another organisation's file (which no real batch does) does not serve it:
    # the file is looked up as the organisation's own
    async with env.app.state.sessionmaker() as session, session.begin():
        await session.execute(
            update(Batch).where(Batch.id == mine.id).values(output_file_id=ended.output_file_id)
        )
    assert (await b.get(f"/batches/{mine.id}/download/output")).status_code == 404

    # alpha's admin and the platform admin see alpha's batches
    assert set(_rows((await a.get("/batches")).text)) == {theirs.id, ended.id}
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    root = await sign_in(str(env.client.base_url), "root@platform.test")
    assert set(_rows((await root.get(f"/batches?org={alpha}")).text)) == {theirs.id, ended.id}
    got = await root.get(f"/batches/{ended.id}/download/output?org={alpha}")
    assert got.status_code == 200 and got.content == await _bytes(service, alpha, ended.output_file_id)
    for s in (a, b, root):
        await s.client.aclose()


async def test_cancel_moves_an_in_progress_batch_to_cancelling(admin_env: AdminEnv) -> None:
    env, service = admin_env, _service(admin_env)
    org_id, s = await _admin_of(env, "alpha")
    running = await _batch(service, org_id, valid=3, ran=((1, True),))
    done = await _batch(service, org_id, valid=1, ran=((1, True),), end="completed")
    await s.get("/batches")  # the page's form token

    # without the form's CSRF token: refused, nothing changes
    r = await s.client.post(f"/dashboard/batches/{running.id}/cancel", data={"org": org_id})
    assert r.status_code == 403 and "This form has expired" in r.text
    r = await s.client.post(
        f"/dashboard/batches/{running.id}/cancel", data={"org": org_id, "_csrf_token": "forged"}
    )
    assert r.status_code == 403
    assert (await service.get(org_id, running.id)).status == "in_progress"

    text = await _follow(s, await s.post(f"/batches/{running.id}/cancel", {"org": org_id}))
    assert _flash(text) == f"ok: Cancelling batch {running.id}: none of its requests start from now on."
    row = await service.get(org_id, running.id)
    assert row.status == "cancelling" and row.cancelling_at is not None
    shown = _rows(text)[running.id]
    assert shown["status"] == "cancelling" and f"/batches/{running.id}/cancel" not in shown["html"]
    # again (a second tab): nothing more to do
    text = await _follow(s, await s.post(f"/batches/{running.id}/cancel", {"org": org_id}))
    assert _flash(text) == f"ok: Batch {running.id} is already cancelling."
    assert (await service.get(org_id, running.id)).cancelling_at == row.cancelling_at
    # a batch that has ended cannot be cancelled: the service's reason, as the page's message
    text = await _follow(s, await s.post(f"/batches/{done.id}/cancel", {"org": org_id}))
    assert _flash(text) == "error: Cannot cancel a batch with status 'completed'."
    assert (await service.get(org_id, done.id)).status == "completed"
    # the one cancel that changed something is in the audit log, as the signed-in user's
    async with env.app.state.sessionmaker() as session:
        entries = list(await session.scalars(select(AuditEntry).where(AuditEntry.resource_type == "batch")))
    assert [(e.action, e.resource_id, e.org_id) for e in entries] == [("cancel", running.id, org_id)]
    assert entries[0].actor_user_id is not None and entries[0].actor_key_id is None
    assert (entries[0].before["status"], entries[0].after["status"]) == ("in_progress", "cancelling")
    await s.client.aclose()


async def test_pages_of_batches(env: AdminEnv) -> None:
    service = _service(env)
    org_id, s = await _admin_of(env, "alpha")
    made = [await _batch(service, org_id, valid=1) for _ in range(PAGE_SIZE + 2)]
    newest_first = sorted((b.id for b in made), reverse=True)
    first = (await s.get("/batches")).text
    assert list(_rows(first)) == newest_first[:PAGE_SIZE]
    older = re.search(r'href="/dashboard(/batches\?org=[^"]+&amp;after=[^"]+)" rel="next"', first)
    assert older and "Newest batches" not in first
    second = (await s.get(older.group(1).replace("&amp;", "&"))).text
    assert list(_rows(second)) == newest_first[PAGE_SIZE:]
    assert 'rel="next"' not in second and "Newest batches" in second
    await s.client.aclose()


async def test_in_a_browser(env: AdminEnv, tmp_path: Path, chromium: str) -> None:
    """An organisation admin finds the page in the navigation, downloads a finished batch's
    output and cancels a running one."""
    service = _service(env)
    org_id, _ = await _admin_of(env, "acme")
    running = await _batch(service, org_id, valid=4, ran=((1, True), (2, False), (3, True)))
    done = await _batch(service, org_id, valid=2, ran=((1, True), (2, True)), end="completed")
    assert done.output_file_id
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

            await page.get_by_role("navigation", name="Main").get_by_role("link", name="Batches").click()
            await page.wait_for_url("**/dashboard/batches")
            row = page.locator(f'#batches tr[data-batch="{running.id}"]')
            assert await row.get_attribute("data-status") == "in_progress"
            assert await row.locator("progress").get_attribute("value") == "3"
            assert "75%" in await row.inner_text()
            await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "batches.png"), full_page=True)

            async with page.expect_download() as info:
                await (
                    page.locator(f'#batches tr[data-batch="{done.id}"]')
                    .get_by_role("link", name="Output")
                    .click()
                )
            download = await info.value
            assert download.suggested_filename == f"{done.id}_output.jsonl"
            saved = tmp_path / "output.jsonl"
            await download.save_as(saved)
            assert await asyncio.to_thread(saved.read_bytes) == await _bytes(
                service, org_id, done.output_file_id
            )

            # cancelling asks first: dismissed, nothing happens; accepted, it cancels
            asked: list[str] = []
            answer_dialogs(page, False, asked)
            await row.get_by_role("button", name="Cancel").click()
            await page.wait_for_timeout(300)
            assert asked and running.id in asked[0], asked
            assert await row.get_attribute("data-status") == "in_progress"
            assert (await service.get(org_id, running.id)).status == "in_progress"
            answer_dialogs(page, True, asked)
            await row.get_by_role("button", name="Cancel").click()
            await page.wait_for_selector(".flash.ok")
            assert f"Cancelling batch {running.id}" in await page.locator(".flash.ok").inner_text()
            assert await row.get_attribute("data-status") == "cancelling"
            assert await row.get_by_role("button", name="Cancel").count() == 0
            await page.screenshot(path=str(ARTIFACTS / "batch-cancelled.png"), full_page=True)
            await context.close()
        finally:
            await browser.close()
    assert (await service.get(org_id, running.id)).status == "cancelling"
