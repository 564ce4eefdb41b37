"""Exports of usage, rollups and invoices as CSV and JSON: through the API (streamed from a
database cursor, each tenant only its own) and the CLI. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.exports.services import USAGE_COLUMNS, _usage_stmt, export_query, stream_export
from billing.jobs import build_invoices, rollup_hours
from tests import databases
from tests.billing.billing_world import (
    FEB,
    JAN,
    MONTH,
    Api,
    add_gpu_price,
    add_model_price,
    add_usage,
    add_worker,
    admin_api,
    t,
)
from tokenmill.db import make_engine

ROOT = Path(__file__).resolve().parents[2]
N = 20_000  # usage rows of the large export


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    await asyncio.to_thread(databases.migrate, db_url)
    async with admin_api(db_url, tmp_path, make_engine(db_url)) as env:
        yield env


async def _month(api: Api) -> None:
    """January 2025 of both tenants: tokens, GPU time, rollups, invoices (A's finalized)."""
    w, sm = api.world, api.sm
    await add_model_price(sm, w.small, JAN, "0.15", "0.075", "0.6")
    await add_gpu_price(sm, "a100", JAN, "2.5")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(3, 4), 1_000_000, 200_000, 500_000, model="small-model"),
            w.usage(
                w.org_a,
                w.small_dep,
                t(3, 5),
                10,
                0,
                1,
                adapter=w.adapter,
                model="acme-lora",
                user='end-user, "quoted"',
                client_request_id="cli-7",
                service_tier="flex",
            ),
            w.usage(w.org_b, w.small_dep, t(4, 5), 2_000_000, 0, 100_000, model="small-model"),
        ],
    )
    await add_worker(sm, "w1", w.dedicated, t(9, 10), stopped=t(9, 11, 30))
    await rollup_hours(sm, JAN, FEB)
    await build_invoices(sm, MONTH)
    async with sm() as s:
        from billing.models import Invoice

        a = await s.scalar(select(Invoice.id).where(Invoice.org_id == w.org_a))
    r = await api.client.post(f"/admin/v1/invoices/{a}/finalize", headers=api.h("platform"))
    assert r.status_code == 200, r.text


def _csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


async def test_csv_and_json_of_each_export(api: Api) -> None:
    c, w = api.client, api.world
    await _month(api)
    span = {"from": "2025-01-01", "to": "2025-02-01T00:00:00Z"}
    r = await c.get("/admin/v1/exports/usage", headers=api.h("platform"), params=span)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    assert r.headers["content-disposition"].startswith('attachment; filename="usage-all-20250101')
    usage = _csv(r.text)
    assert [(u["org_id"], u["prompt_tokens"], u["adapter"]) for u in usage] == [
        (w.org_a, "1000000", ""),
        (w.org_a, "10", w.adapter),
        (w.org_b, "2000000", ""),
    ]
    assert usage[0]["created_at"] == "2025-01-03T04:00:00Z"
    # each request at the January price: (prompt - cached) x 0.15 + cached x 0.075 + output x 0.6 per 1M
    assert [(u["cost"], u["currency"]) for u in usage] == [
        ("0.435", "usd"),
        ("0.0000021", "usd"),
        ("0.36", "usd"),
    ]
    # The request's context, as the gateway recorded it ("" in CSV where there was none).
    assert [(u["user"], u["client_request_id"], u["service_tier"]) for u in usage] == [
        ("", "", "default"),
        ('end-user, "quoted"', "cli-7", "flex"),
        ("", "", "default"),
    ]
    r = await c.get("/admin/v1/exports/usage", headers=api.h("platform"), params=span | {"format": "json"})
    assert r.headers["content-type"].startswith("application/json")
    as_json = r.json()
    assert [list(u) for u in as_json] == [list(USAGE_COLUMNS)] * 3
    assert (as_json[1]["adapter"], as_json[1]["prompt_tokens"], as_json[1]["ttft_ms"]) == (
        w.adapter,
        10,
        None,
    )
    assert [(u["user"], u["client_request_id"], u["service_tier"]) for u in as_json] == [
        (None, None, "default"),
        ('end-user, "quoted"', "cli-7", "flex"),
        (None, None, "default"),
    ]

    r = await c.get("/admin/v1/exports/rollups", headers=api.h("platform"), params=span)
    rollups = _csv(r.text)
    gpu = [x for x in rollups if x["meter"] == "gpu_seconds"]
    assert [(x["hour"], x["quantity"], x["unit_price"], x["amount"]) for x in gpu] == [
        ("2025-01-09T10:00:00Z", "3600", "2.5", "2.5"),
        ("2025-01-09T11:00:00Z", "1800", "2.5", "1.25"),
    ]
    inputs = [x for x in rollups if x["meter"] == "input" and x["org_id"] == w.org_a]
    assert [(x["adapter"], x["quantity"], x["amount"]) for x in inputs] == [
        ("", "800000", "0.12"),
        (w.adapter, "10", "0.0000015"),
    ]
    r = await c.get("/admin/v1/exports/rollups", headers=api.h("platform"), params=span | {"format": "json"})
    assert len(r.json()) == len(rollups) and r.json()[0]["quantity"] == rollups[0]["quantity"]

    r = await c.get("/admin/v1/exports/invoices", headers=api.h("platform"), params=span)
    lines = _csv(r.text)
    totals = {(x["org_id"], x["status"], x["number"], x["total"]) for x in lines}
    # A: 0.12 + 0.02 (0.015 half-even) + 0.30 + adapter 0.00 + 0.00 + GPU 3.75 = 4.19
    assert totals == {(w.org_a, "finalized", "TM-000001", "4.19"), (w.org_b, "draft", "", "0.36")}
    assert sum(float(x["line_amount"]) for x in lines if x["org_id"] == w.org_a) == pytest.approx(4.19)
    r = await c.get("/admin/v1/exports/invoices", headers=api.h("platform"), params=span | {"format": "json"})
    invoices = r.json()
    assert [(i["org_id"], len(i["lines"])) for i in invoices] == [
        (x, n) for x, n in sorted([(w.org_a, 6), (w.org_b, 2)])
    ]
    one = next(i for i in invoices if i["org_id"] == w.org_a)
    assert one["lines"][-1]["description"].startswith("Dedicated deployment acme-big")
    assert all(isinstance(x["amount"], str) for x in one["lines"])  # exact decimals, not floats


async def test_exports_tell_batch_usage_apart(api: Api) -> None:
    """The usage export names each request's batch (none for online requests); the rollups
    and invoices exports carry the batch meters at the discounted price."""
    c, w, sm = api.client, api.world, api.sm
    await add_model_price(sm, w.small, JAN, "0.15", "0.075", "0.6")
    await add_usage(
        sm,
        [
            w.usage(w.org_a, w.small_dep, t(3, 4), 1_000_000, 0, 0, model="small-model"),
            w.usage(
                w.org_a, w.small_dep, t(3, 5), 600_000, 0, 100_000, model="small-model", batch_id="batch_x1"
            ),
        ],
    )
    await rollup_hours(sm, JAN, FEB)
    await build_invoices(sm, MONTH)
    span = {"from": "2025-01", "to": "2025-02"}
    r = await c.get("/admin/v1/exports/usage", headers=api.h("admin_a"), params=span)
    assert r.status_code == 200, r.text
    assert r.text.splitlines()[0].split(",") == list(USAGE_COLUMNS)
    assert USAGE_COLUMNS[-3:] == ("batch_id", "cost", "currency")  # new columns go at the end
    # the batch line at half price: 600,000 x 0.075 + 100,000 x 0.3 per 1M
    assert [(u["prompt_tokens"], u["batch_id"], u["cost"], u["currency"]) for u in _csv(r.text)] == [
        ("1000000", "", "0.15", "usd"),
        ("600000", "batch_x1", "0.075", "usd"),
    ]
    r = await c.get("/admin/v1/exports/usage", headers=api.h("admin_a"), params=span | {"format": "json"})
    assert [(u["prompt_tokens"], u["batch_id"], u["cost"]) for u in r.json()] == [
        (1_000_000, None, "0.15"),
        (600_000, "batch_x1", "0.075"),
    ]

    r = await c.get("/admin/v1/exports/rollups", headers=api.h("admin_a"), params=span)
    assert sorted((x["meter"], x["quantity"], x["unit_price"], x["amount"]) for x in _csv(r.text)) == [
        ("batch_input", "600000", "0.075", "0.045"),
        ("batch_output", "100000", "0.3", "0.03"),
        ("input", "1000000", "0.15", "0.15"),
    ]
    r = await c.get("/admin/v1/exports/invoices", headers=api.h("admin_a"), params=span | {"format": "json"})
    (invoice,) = r.json()
    # 0.045 -> 0.04 (half-even)
    assert [(x["meter"], x["amount"]) for x in invoice["lines"]] == [
        ("input", "0.15"),
        ("batch_input", "0.04"),
        ("batch_output", "0.03"),
    ]
    assert invoice["total"] == "0.22"
    assert invoice["lines"][1]["description"] == "small-model: batch input tokens at 0.075 USD per 1M tokens"


async def test_exports_are_confined_to_the_callers_tenant(api: Api) -> None:
    c, w = api.client, api.world
    await _month(api)
    span = {"from": "2025-01", "to": "2025-02"}
    for what, column in (("usage", "org_id"), ("rollups", "org_id"), ("invoices", "org_id")):
        for who, org in (("admin_a", w.org_a), ("admin_b", w.org_b)):
            r = await c.get(f"/admin/v1/exports/{what}", headers=api.h(who), params=span)
            assert r.status_code == 200, r.text
            rows = _csv(r.text)
            assert rows and {x[column] for x in rows} == {org}, (what, who)
            own = await c.get(f"/admin/v1/exports/{what}", headers=api.h(who), params=span | {"org": org})
            assert own.text == r.text
        other = await c.get(
            f"/admin/v1/exports/{what}", headers=api.h("admin_a"), params=span | {"org": "globex"}
        )
        assert other.status_code == 404, other.text
        assert (await c.get(f"/admin/v1/exports/{what}", headers=api.h("member_a"))).status_code == 403
        assert (await c.get(f"/admin/v1/exports/{what}")).status_code == 401
    r = await c.get("/admin/v1/exports/usage", headers=api.h("platform"), params=span | {"org": "globex"})
    assert {x["org_id"] for x in _csv(r.text)} == {w.org_b}


async def test_bad_export_parameters(api: Api) -> None:
    c, h = api.client, api.h("platform")
    for params, param in (
        ({"format": "xml"}, "format"),
        ({"from": "last tuesday"}, "from"),
        ({"to": "2025-13"}, "to"),
        ({"from": "2025-02-01", "to": "2025-01-01"}, "to"),
    ):
        r = await c.get("/admin/v1/exports/usage", headers=h, params=params)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = await c.get("/admin/v1/exports/keys", headers=h)
    assert r.status_code == 404
    r = await c.get("/admin/v1/exports/usage", headers=h, params={"org": "no-such-org"})
    assert r.status_code == 404


async def _many(api: Api) -> None:
    w = api.world
    rows = [
        w.usage(
            w.org_a if i % 4 else w.org_b,
            w.small_dep,
            JAN + timedelta(seconds=i * 97),
            100 + i % 50,
            i % 7,
            i % 30,
        )
        for i in range(N)
    ]
    await add_usage(api.sm, rows)


async def test_a_large_range_streams(api: Api) -> None:
    """20,000 rows arrive in many chunks as the server reads them, parse as CSV and JSON, and
    an organisation admin's export holds exactly its own."""
    c, w = api.client, api.world
    await _many(api)
    params = {"from": "2025-01-01", "to": "2025-02-01"}
    for fmt in ("csv", "json"):
        chunks = 0
        body = bytearray()
        async with c.stream(
            "GET", "/admin/v1/exports/usage", headers=api.h("platform"), params=params | {"format": fmt}
        ) as r:
            assert r.status_code == 200
            assert r.headers.get("transfer-encoding") == "chunked"  # no content-length: streamed
            async for chunk in r.aiter_raw():
                chunks += 1
                body += chunk
        assert chunks > 10, chunks
        if fmt == "csv":
            rows = _csv(body.decode())
            assert len(rows) == N and len({x["request_id"] for x in rows}) == N
            assert sum(int(x["prompt_tokens"]) for x in rows) == sum(100 + i % 50 for i in range(N))
        else:
            rows = json.loads(body)
            assert len(rows) == N and rows[-1]["request_id"] == f"req-{N:07d}"
    r = await c.get("/admin/v1/exports/usage", headers=api.h("admin_b"), params=params)
    rows = _csv(r.text)
    assert len(rows) == N // 4 and {x["org_id"] for x in rows} == {w.org_b}


async def _peak(run: Callable[[], Awaitable[None]]) -> int:
    tracemalloc.start()
    try:
        await run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def test_streaming_holds_a_bounded_part_in_memory(api: Api) -> None:
    """The export never holds the range: its peak (Python) memory stays the same for four
    times the rows, and is a fraction of what fetching the same rows at once takes."""
    await _many(api)
    sm: async_sessionmaker[AsyncSession] = api.sm
    quarter = (JAN + timedelta(seconds=N // 4 * 97)).isoformat()

    def export(end: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            async with sm() as s:
                async for _ in stream_export(s, export_query("usage", "csv", "2025-01-01", end, None)):
                    pass

        return run

    async def fetch_all() -> None:
        async with sm() as s:
            rows = (
                await s.execute(_usage_stmt(export_query("usage", "csv", "2025-01", "2025-02", None)))
            ).all()
            assert len(rows) == N

    await export(quarter)()  # warm up: compiled statements, connections
    small, full, loaded = (
        await _peak(export(quarter)),
        await _peak(export("2025-02-01")),
        await _peak(fetch_all),
    )
    assert full < small * 1.5, (small, full)
    assert full < loaded / 3, (full, loaded)


def _cli(db_url: str, home: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = os.environ | {
        "DATABASE_URL": db_url,
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_SECRET_KEY": "cli-secret",
    }
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "admin", "export", *args],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


async def test_cli_export(api: Api, db_url: str, tmp_path: Path) -> None:
    w = api.world
    await _month(api)
    out = await asyncio.to_thread(_cli, db_url, tmp_path, "usage", "--from", "2025-01", "--to", "2025-02")
    assert out.returncode == 0, out.stderr.decode()
    assert len(_csv(out.stdout.decode())) == 3
    out = await asyncio.to_thread(
        _cli,
        db_url,
        tmp_path,
        "invoices",
        "--format",
        "json",
        "--from",
        "2025-01",
        "--to",
        "2025-02",
        "--org",
        "acme",
    )
    assert out.returncode == 0, out.stderr.decode()
    assert [(i["org_id"], i["number"], i["total"]) for i in json.loads(out.stdout)] == [
        (w.org_a, "TM-000001", "4.19")
    ]
    target = tmp_path / "rollups.csv"
    out = await asyncio.to_thread(
        _cli,
        db_url,
        tmp_path,
        "rollups",
        "--from",
        "2025-01-01",
        "--to",
        "2025-02-01",
        "--org",
        w.org_b,
        "-o",
        str(target),
    )
    assert out.returncode == 0 and out.stdout == b""
    assert {x["org_id"] for x in _csv(target.read_text())} == {w.org_b}
    bad = await asyncio.to_thread(_cli, db_url, tmp_path, "usage", "--from", "whenever")
    assert bad.returncode == 1 and b"from must be an ISO 8601 date" in bad.stderr
    bad = await asyncio.to_thread(_cli, db_url, tmp_path, "usage", "--org", "nobody")
    assert bad.returncode == 1 and b"No organisation 'nobody'" in bad.stderr
