"""Billing's admin API through a real server: the price book, rollups, invoices; who may
do what (another tenant's invoices answer 404 like missing ones); bad input is a 400
naming the parameter. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

from billing.models import Invoice, Price
from control_plane.audit.models import AuditEntry
from tests import databases
from tests.billing.billing_world import FEB, JAN, MONTH, Api, add_usage, admin_api, t
from tokenmill.db import make_engine, utcnow


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    await asyncio.to_thread(databases.migrate, db_url)
    async with admin_api(db_url, tmp_path, make_engine(db_url)) as env:
        yield env


def _error(r: object, status: int, param: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    err = r.json()["error"]  # type: ignore[attr-defined]
    if param is not None:
        assert err["param"] == param, err
    return err


async def _priced_month(api: Api) -> dict[str, str]:
    """Prices, usage of both tenants in January 2025, rolled up; their draft invoice ids."""
    c, w = api.client, api.world
    r = await c.post(
        "/admin/v1/prices/models",
        headers=api.h("platform"),
        json={
            "model": "small-model",
            "input_per_mtok": "0.15",
            "cached_input_per_mtok": "0.075",
            "output_per_mtok": 0.6,
            "effective_from": "2025-01-01T00:00:00Z",
        },
    )
    assert r.status_code == 201, r.text
    await add_usage(
        api.sm,
        [
            w.usage(w.org_a, w.small_dep, t(3, 4), 1_000_000, 200_000, 500_000),
            w.usage(w.org_b, w.small_dep, t(4, 5), 2_000_000, 0, 100_000),
        ],
    )
    r = await c.post(
        "/admin/v1/rollups", headers=api.h("platform"), json={"from": "2025-01", "to": "2025-02"}
    )
    assert r.status_code == 201, r.text
    assert r.json() == {
        "from": "2025-01-01T00:00:00Z",
        "to": "2025-02-01T00:00:00Z",
        "rows": 5,
        "inserted": 5,
        "updated": 0,
        "deleted": 0,
    }
    r = await c.post("/admin/v1/invoices/generate", headers=api.h("platform"), json={"month": MONTH})
    assert r.status_code == 200, r.text
    async with api.sm() as s:
        return {i.org_id: i.id for i in await s.scalars(select(Invoice))}


async def test_price_book_versions(api: Api) -> None:
    c = api.client
    body = {"model": "small-model", "input_per_mtok": "0.10", "output_per_mtok": "0.30"}
    r = await c.post("/admin/v1/prices/models", headers=api.h("platform"), json=body)
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["model"] == "small-model" and first["model_id"] == api.world.small
    # Money as exact decimal strings; cached input defaults to the input price, and batch
    # requests to half price.
    assert (first["input_per_mtok"], first["cached_input_per_mtok"], first["output_per_mtok"]) == (
        "0.1",
        "0.1",
        "0.3",
    )
    assert first["batch_discount"] == "0.5"
    later = {**body, "input_per_mtok": "0.20", "effective_from": "2100-01-01T00:00:00Z"}
    r = await c.post("/admin/v1/prices/models", headers=api.h("platform"), json=later)
    assert r.status_code == 201, r.text
    # The same moment twice: history is added to, never overwritten.
    _error(
        await c.post("/admin/v1/prices/models", headers=api.h("platform"), json=later), 409, "effective_from"
    )

    r = await c.get("/admin/v1/prices/models", headers=api.h("admin_a"))  # org admins read it
    assert [(p["input_per_mtok"], p["effective_from"]) for p in r.json()] == [
        ("0.1", first["effective_from"]),
        ("0.2", "2100-01-01T00:00:00Z"),
    ]
    r = await c.get(
        "/admin/v1/prices/models",
        headers=api.h("admin_b"),
        params={"at": "2099-12-31", "model": "small-model"},
    )
    assert [p["id"] for p in r.json()] == [first["id"]]

    r = await c.post(
        "/admin/v1/prices/gpus", headers=api.h("platform"), json={"gpu_type": "a100", "per_hour": "2.5"}
    )
    assert r.status_code == 201, r.text
    assert r.json()["per_hour"] == "2.5"
    r = await c.get("/admin/v1/prices/gpus", headers=api.h("admin_b"), params={"gpu_type": "a100"})
    assert [p["gpu_type"] for p in r.json()] == ["a100"]
    async with api.sm() as s:
        audited = list(
            await s.scalars(select(AuditEntry.resource_id).where(AuditEntry.resource_type == "price"))
        )
    assert first["id"] in audited and len(audited) == 3


async def test_price_book_refuses_bad_input(api: Api) -> None:
    c, h = api.client, api.h("platform")
    ok = {"model": "small-model", "input_per_mtok": "1", "output_per_mtok": "1"}
    for change, param in (
        ({"input_per_mtok": "-1"}, "input_per_mtok"),
        ({"output_per_mtok": "NaN"}, "output_per_mtok"),
        ({"cached_input_per_mtok": "0.0000000001"}, "cached_input_per_mtok"),  # 10 decimals
        ({"input_per_mtok": "1e12"}, "input_per_mtok"),
        ({"model": "no-such-model"}, "model"),
        ({"currency": "dollars"}, "currency"),
        ({"currency": "u$d"}, "currency"),
        ({"effective_from": "yesterday"}, "effective_from"),
        ({"input_price": "1"}, "input_price"),  # a typo is not silently ignored
        ({"batch_discount": "-0.1"}, "batch_discount"),
        ({"batch_discount": "1.0001"}, "batch_discount"),
        ({"batch_discount": 2}, "batch_discount"),
        ({"batch_discount": "0.12345"}, "batch_discount"),  # the column keeps 4 decimals
        ({"batch_discount": "NaN"}, "batch_discount"),
        ({"batch_discount": "Infinity"}, "batch_discount"),
        ({"batch_discount": "half"}, "batch_discount"),
    ):
        _error(await c.post("/admin/v1/prices/models", headers=h, json=ok | change), 400, param)
    _error(
        await c.post("/admin/v1/prices/models", headers=h, json={"model": "small-model"}),
        400,
        "input_per_mtok",
    )
    _error(
        await c.post("/admin/v1/prices/gpus", headers=h, json={"gpu_type": "", "per_hour": "1"}),
        400,
        "gpu_type",
    )
    _error(
        await c.post("/admin/v1/prices/gpus", headers=h, json={"gpu_type": "x", "per_hour": "-2"}),
        400,
        "per_hour",
    )
    _error(await c.get("/admin/v1/prices/models", headers=h, params={"at": "soon"}), 400, "at")


async def test_batch_discount_round_trips(api: Api) -> None:
    """Each price version carries its batch discount, from none (0) to free (1), and lists
    it as stored; a refused one leaves no version behind."""
    c, h = api.client, api.h("platform")
    # (sent, answered): a JSON number or a string, answered without trailing zeros or sign.
    for year, (discount, answer) in enumerate((("-0", "0"), ("0.25", "0.25"), (1, "1"), ("0.3750", "0.375"))):
        body = {
            "model": "big-model",
            "input_per_mtok": "2",
            "output_per_mtok": "8",
            "batch_discount": discount,
            "effective_from": f"{2030 + year}-01-01T00:00:00Z",
        }
        r = await c.post("/admin/v1/prices/models", headers=h, json=body)
        assert r.status_code == 201, r.text
        assert r.json()["batch_discount"] == answer
    r = await c.get("/admin/v1/prices/models", headers=api.h("admin_a"), params={"model": "big-model"})
    assert [p["batch_discount"] for p in r.json()] == ["0", "0.25", "1", "0.375"]
    r = await c.get("/admin/v1/prices/models", headers=h, params={"model": "big-model", "at": "2031-06-01"})
    assert [(p["input_per_mtok"], p["batch_discount"]) for p in r.json()] == [("2", "0.25")]
    async with api.sm() as s:
        stored = list(
            await s.scalars(
                select(Price.batch_discount)
                .where(Price.model_id == api.world.big)
                .order_by(Price.effective_from)
            )
        )
    assert stored == [Decimal("0"), Decimal("0.25"), Decimal("1"), Decimal("0.375")]
    bad = {"model": "big-model", "input_per_mtok": "2", "output_per_mtok": "8", "batch_discount": "1.5"}
    err = _error(await c.post("/admin/v1/prices/models", headers=h, json=bad), 400, "batch_discount")
    assert "between 0 and 1" in str(err["message"])
    async with api.sm() as s:
        assert len(list(await s.scalars(select(Price.id).where(Price.model_id == api.world.big)))) == 4


async def test_invoices_through_the_api(api: Api) -> None:
    c, w = api.client, api.world
    ids = await _priced_month(api)
    r = await c.get(f"/admin/v1/invoices/{ids[w.org_a]}", headers=api.h("platform"))
    assert r.status_code == 200, r.text
    inv = r.json()
    # 800k x 0.15 = 0.12; 200k x 0.075 = 0.015 -> 0.02 (half-even); 500k x 0.6 = 0.30
    assert [(x["meter"], x["quantity"], x["unit"], x["unit_price"], x["amount"]) for x in inv["lines"]] == [
        ("input", "800000", "1M tokens", "0.15", "0.12"),
        ("cached_input", "200000", "1M tokens", "0.075", "0.02"),
        ("output", "500000", "1M tokens", "0.6", "0.30"),
    ]
    assert (inv["status"], inv["number"], inv["subtotal"], inv["total"], inv["currency"]) == (
        "draft",
        None,
        "0.44",
        "0.44",
        "usd",
    )
    assert inv["lines"][0]["description"] == "small-model: input tokens at 0.15 USD per 1M tokens"

    r = await c.post(f"/admin/v1/invoices/{ids[w.org_a]}/finalize", headers=api.h("platform"))
    assert r.status_code == 200, r.text
    done = r.json()
    assert (done["status"], done["number"], done["total"]) == ("finalized", "TM-000001", "0.44")
    r = await c.post(f"/admin/v1/invoices/{ids[w.org_a]}/finalize", headers=api.h("platform"))
    assert r.json() == done  # a no-op the second time

    r = await c.get("/admin/v1/invoices", headers=api.h("platform"), params={"month": MONTH})
    assert sorted((i["org_id"], i["status"]) for i in r.json()) == sorted(
        [(w.org_a, "finalized"), (w.org_b, "draft")]
    )
    assert all("lines" not in i for i in r.json())
    r = await c.get(
        "/admin/v1/invoices", headers=api.h("platform"), params={"status": "draft", "org": "globex"}
    )
    assert [i["id"] for i in r.json()] == [ids[w.org_b]]
    async with api.sm() as s:
        audit = (await s.scalars(select(AuditEntry).where(AuditEntry.resource_id == ids[w.org_a]))).all()
    assert [(a.action, a.before["status"], a.after["status"]) for a in audit] == [
        ("finalize", "draft", "finalized")
    ]


async def test_the_running_month_is_finalized_only_with_force(api: Api) -> None:
    c, w, h = api.client, api.world, api.h("platform")
    body = {"model": "small-model", "input_per_mtok": "1", "output_per_mtok": "1"}
    assert (await c.post("/admin/v1/prices/models", headers=h, json=body)).status_code == 201
    now = utcnow()
    await add_usage(api.sm, [w.usage(w.org_a, w.small_dep, now, 10**6)])
    span = {"from": now.strftime("%Y-%m"), "to": (now + timedelta(hours=1)).isoformat()}
    assert (await c.post("/admin/v1/rollups", headers=h, json=span)).json()["inserted"] == 1
    r = await c.post("/admin/v1/invoices/generate", headers=h, json={"month": now.strftime("%Y-%m")})
    (inv_id,) = r.json()["created"]
    err = _error(await c.post(f"/admin/v1/invoices/{inv_id}/finalize", headers=h), 409, "force")
    assert err["code"] == "period_not_over"
    r = await c.post(f"/admin/v1/invoices/{inv_id}/finalize", headers=h, params={"force": "true"})
    assert r.status_code == 200 and (r.json()["status"], r.json()["total"]) == ("finalized", "1.00")


async def test_tenants_see_only_their_own(api: Api) -> None:
    c, w = api.client, api.world
    ids = await _priced_month(api)
    a, b = ids[w.org_a], ids[w.org_b]
    r = await c.get("/admin/v1/invoices", headers=api.h("admin_a"))
    assert [i["id"] for i in r.json()] == [a]
    for who, org in (("admin_a", "globex"), ("admin_a", w.org_b), ("admin_b", "acme")):
        _error(await c.get("/admin/v1/invoices", headers=api.h(who), params={"org": org}), 404)
    assert (await c.get(f"/admin/v1/invoices/{a}", headers=api.h("admin_a"))).status_code == 200
    _error(await c.get(f"/admin/v1/invoices/{b}", headers=api.h("admin_a")), 404)
    _error(await c.get(f"/admin/v1/invoices/{a}", headers=api.h("admin_b")), 404)
    # Finalizing is the platform's: an org admin's own invoice is 403, another's 404.
    _error(await c.post(f"/admin/v1/invoices/{a}/finalize", headers=api.h("admin_a")), 403)
    _error(await c.post(f"/admin/v1/invoices/{b}/finalize", headers=api.h("admin_a")), 404)
    for path, body in (
        ("/admin/v1/prices/models", {"model": "small-model", "input_per_mtok": "9", "output_per_mtok": "9"}),
        ("/admin/v1/prices/gpus", {"gpu_type": "h100", "per_hour": "9"}),
        ("/admin/v1/rollups", {"from": "2025-01", "to": "2025-02"}),
        ("/admin/v1/invoices/generate", {"month": MONTH}),
    ):
        _error(await c.post(path, headers=api.h("admin_a"), json=body), 403)
    # Member keys are for inference; no key at all is a 401.
    for path in (
        "/admin/v1/invoices",
        f"/admin/v1/invoices/{a}",
        "/admin/v1/prices/models",
        "/admin/v1/exports/usage",
    ):
        _error(await c.get(path, headers=api.h("member_a")), 403)
        _error(await c.get(path), 401)
    async with api.sm() as s:
        statuses = set(await s.scalars(select(Invoice.status)))
    assert statuses == {"draft"}  # nothing the tenants tried changed anything


async def test_bad_parameters_are_400s_naming_them(api: Api) -> None:
    c, h = api.client, api.h("platform")
    for params, param in (
        ({"month": "2025-13"}, "month"),
        ({"month": "January"}, "month"),
        ({"status": "paid"}, "status"),
        ({"limit": "0"}, "limit"),
    ):
        _error(await c.get("/admin/v1/invoices", headers=h, params=params), 400, param)
    _error(await c.post("/admin/v1/invoices/generate", headers=h, json={"month": "25-1"}), 400, "month")
    _error(await c.post("/admin/v1/invoices/generate", headers=h, json={}), 400, "month")
    for body, param in (
        ({"from": "2025-01-01", "to": "not a time"}, "to"),
        ({"from": "2025-02-01", "to": "2025-01-01"}, "to"),
        ({"from": "2020-01-01", "to": "2025-01-01"}, "to"),  # too long a range at once
        ({"to": "2025-01-01"}, "from"),
    ):
        _error(await c.post("/admin/v1/rollups", headers=h, json=body), 400, param)
    _error(await c.get("/admin/v1/invoices/inv_nope", headers=h), 404)
    _error(await c.post("/admin/v1/invoices/inv_nope/finalize", headers=h), 404)


async def test_rollups_endpoint_reruns_without_changes(api: Api) -> None:
    c, w = api.client, api.world
    await add_usage(api.sm, [w.usage(w.org_a, w.small_dep, t(2, 3), 100, 0, 10)])
    body = {"from": JAN.isoformat(), "to": FEB.isoformat()}
    first = (await c.post("/admin/v1/rollups", headers=api.h("platform"), json=body)).json()
    second = (await c.post("/admin/v1/rollups", headers=api.h("platform"), json=body)).json()
    assert (first["inserted"], second["inserted"], second["updated"], second["deleted"]) == (2, 0, 0, 0)
    assert first["rows"] == second["rows"] == 2
    r = await c.post("/admin/v1/invoices/generate", headers=api.h("platform"), json={"month": MONTH})
    assert r.json()["created"] == []  # no price: metered, not invoiced


async def test_documented_in_openapi(api: Api) -> None:
    paths = (await api.client.get("/openapi.json")).json()["paths"]
    for path in (
        "/admin/v1/prices/models",
        "/admin/v1/prices/gpus",
        "/admin/v1/rollups",
        "/admin/v1/invoices",
        "/admin/v1/invoices/generate",
        "/admin/v1/invoices/{invoice_id}",
        "/admin/v1/invoices/{invoice_id}/finalize",
        "/admin/v1/exports/{what}",
    ):
        assert path in paths, path
    params = {p["name"] for p in paths["/admin/v1/exports/{what}"]["get"]["parameters"]}
    assert {"format", "from", "to", "org"} <= params
