"""The dashboard's usage, invoice, price and plan pages (HTTP only: reads and writes go
through billing's and the control plane's services; services.py shapes the charts' windows).

Downloads are billing's exports (billing/exports/services.py): the same files as the admin
API's `GET /admin/v1/exports/...`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Stream, Template
from sqlalchemy.ext.asyncio import AsyncSession

from billing.exports.services import ExportQuery, export_chunks, invoice_document
from billing.invoices.services import get_invoice, list_invoices
from billing.prices.services import PriceBook
from control_plane.audit.services import record_change
from control_plane.plans.schemas import PlanCreate
from control_plane.policy import (
    WHILE_SUSPENDED,
    Principal,
    require_platform_admin,
)
from control_plane.unit import UnitOfWork
from control_plane.wire import parse
from dashboard import charts
from dashboard.services import (
    Series,
    UsageFilter,
    org_names,
    usage_series,
    window,
)
from dashboard.web import (
    admin_of,
    attempt,
    form_decimal,
    form_fields,
    form_int,
    page,
)
from tokenmill.errors import APIError

# --- usage charts ---------------------------------------------------------------------------


def usage_charts(series: Series, prefix: str) -> list[dict[str, Any]]:
    """The charts of a usage series: requests, tokens, spend (when known) and error rate."""
    hourly = series.window.hourly

    def points(value: Callable[[Any], float]) -> list[charts.Point]:
        return [charts.Point(b.at, value(b)) for b in series.buckets]

    out = [
        ("requests", "Requests", points(lambda b: b.requests), "bar", charts.compact),
        ("tokens", "Tokens (prompt + completion)", points(lambda b: b.tokens), "bar", charts.compact),
    ]
    if series.spend_known:
        currency = series.currency.upper()
        out.append(
            (
                "spend",
                f"Spend ({currency}, from hourly rollups)",
                points(lambda b: float(b.spend or 0)),
                "bar",
                lambda v: f"{v:,.2f}",
            )
        )
    out.append(("errors", "Error rate", points(lambda b: b.error_rate), "line", lambda v: f"{v * 100:.1f}%"))
    return [
        {
            "id": f"{prefix}-{key}",
            "title": title,
            "svg": charts.render(
                pts, chart_id=f"{prefix}-{key}", title=title, hourly=hourly, kind=kind, fmt=fmt
            ),
        }
        for key, title, pts, kind, fmt in out
    ]


# --- usage ----------------------------------------------------------------------------------


async def _usage_filter(
    uow: UnitOfWork, admin: Principal, org: str | None, key: str | None, model: str | None
) -> tuple[UsageFilter, Any]:
    org_id = await uow.orgs.scope(org, admin)
    found = None
    if key:
        found = await uow.keys.visible(key, admin)
        if org_id is not None and found.org_id != org_id:
            raise APIError(404, f"No API key '{key}'.", code="not_found")
    return UsageFilter(org_id=org_id, key_id=found.id if found else None, model=model or None), found


@get("/usage", opt=WHILE_SUSPENDED)
async def usage(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    range: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    start = request.query_params.get("from")  # a Python keyword, so not a parameter
    filt, _ = await _usage_filter(uow, admin, org, key, model)
    win = window(range or ("7d" if not (start or to) else None), start, to)
    series = await usage_series(uow.session, win, filt)
    key_choices = await uow.keys.list_for_org(filt.org_id) if filt.org_id else []
    deps = await uow.deployments.list_visible(admin)
    names = sorted({d.name for d in deps})
    if filt.org_id:
        names += sorted(a.name for a in await uow.adapters.list_for_org(filt.org_id))
    params = {
        "org": org or "",
        "key": key or "",
        "model": model or "",
        "from": win.from_date,
        "to": win.to_date,
    }
    return page(
        request,
        "usage.html",
        title="Usage",
        current="usage",
        series=series,
        charts=[c for c in usage_charts(series, "usage") if not c["id"].endswith("errors")],
        win=win,
        filt=filt,
        orgs=await org_names(uow.session, admin),
        key_choices=key_choices,
        model_names=names,
        params=params,
        csv_query="&".join(f"{k}={v}" for k, v in params.items() if v),
    )


@get("/usage.csv", opt=WHILE_SUSPENDED)
async def usage_export(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Stream:
    """Every ledger row of the filter, as the admin API's usage export writes them."""
    admin = admin_of(request)
    start = request.query_params.get("from")
    filt, _ = await _usage_filter(uow, admin, org, key, model)
    win = window("7d" if not (start or to) else None, start, to)
    query = ExportQuery(
        "usage", "csv", win.start, win.end, org_id=filt.org_id, key_id=filt.key_id, model=filt.model
    )
    name = f"usage-{filt.org_id or 'all'}-{win.from_date}-{win.to_date}.csv"
    return Stream(
        export_chunks(request.app.state.sessionmaker, query),
        media_type=query.media_type,
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )


# --- invoices -------------------------------------------------------------------------------


@get("/invoices", opt=WHILE_SUSPENDED)
async def invoices(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    month: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await uow.orgs.scope(org, admin)
    found = await list_invoices(
        uow.session, org_id=org_id, month=month or None, status=status or None, limit=200
    )
    return page(
        request,
        "invoices.html",
        title="Invoices",
        current="invoices",
        invoices=found,
        orgs=await org_names(uow.session, admin),
        params={"org": org or "", "month": month or "", "status": status or ""},
    )


async def _invoice(db: AsyncSession, admin: Principal, invoice_id: str) -> Any:
    # Another organisation's invoice reads exactly like a missing one.
    return await get_invoice(db, invoice_id, org_id=None if admin.is_platform_admin else admin.org_id or "")


@get("/invoices/{invoice_id:str}", opt=WHILE_SUSPENDED)
async def invoice(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], invoice_id: FromPath[str]
) -> Template:
    admin = admin_of(request)
    found = await _invoice(uow.session, admin, invoice_id)
    return page(
        request,
        "invoice.html",
        title=f"Invoice {found.id}",
        current="invoices",
        invoice=found,
        org_name=(await org_names(uow.session, admin)).get(found.org_id, found.org_id),
    )


@get("/invoices/{invoice_id:str}/download/{fmt:str}", opt=WHILE_SUSPENDED)
async def invoice_download(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    invoice_id: FromPath[str],
    fmt: FromPath[str],
) -> Response[bytes]:
    found = await _invoice(uow.session, admin_of(request), invoice_id)
    if fmt not in ("csv", "json"):
        raise APIError(404, "Download as csv or json.")
    body = await invoice_document(uow.session, found, fmt)
    media = "text/csv; charset=utf-8" if fmt == "csv" else "application/json"
    return Response(
        body,
        media_type=media,
        headers={"content-disposition": f'attachment; filename="invoice-{found.id}.{fmt}"'},
    )


# --- prices and plans -----------------------------------------------------------------------


@get("/prices")
async def prices(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Template:
    book = PriceBook(uow.session)
    catalogue = await uow.models.list_models()
    return page(
        request,
        "prices.html",
        title="Prices & plans",
        current="prices",
        model_prices=await book.model_prices(),
        current_prices={m.id: p.id for p, m in await book.model_prices(at=datetime.now(UTC))},
        gpu_prices=await book.gpu_prices(),
        plans=await uow.plans.list_plans(),
        models=list(catalogue),
    )


@post("/prices/models")
async def add_model_price(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    async def act() -> str:
        require_platform_admin(admin, "set prices")
        input_price = form_decimal(fields.get("input_per_mtok"), "input_per_mtok")
        output_price = form_decimal(fields.get("output_per_mtok"), "output_per_mtok")
        if input_price is None or output_price is None:
            raise APIError(400, "Give the input and output prices.", param="input_per_mtok")
        price, model = await PriceBook(uow.session).add_model_price(
            model_ref=fields.get("model", ""),
            input_per_mtok=input_price,
            output_per_mtok=output_price,
            cached_input_per_mtok=form_decimal(fields.get("cached_input_per_mtok"), "cached_input_per_mtok"),
            currency=fields.get("currency") or "usd",
        )
        await record_change(uow.session, admin, "create", "price", price.id, org_id=None, after=price)
        return f"New price of {model.name} in effect from now."

    return await attempt(request, uow, "/prices", act)


@post("/prices/gpus")
async def add_gpu_price(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    async def act() -> str:
        require_platform_admin(admin, "set prices")
        per_hour = form_decimal(fields.get("per_hour"), "per_hour")
        if per_hour is None:
            raise APIError(400, "Give the price per GPU-hour.", param="per_hour")
        price = await PriceBook(uow.session).add_gpu_price(
            gpu_type=fields.get("gpu_type", ""), per_hour=per_hour, currency=fields.get("currency") or "usd"
        )
        await record_change(uow.session, admin, "create", "price", price.id, org_id=None, after=price)
        return f"New price of {price.gpu_type} in effect from now."

    return await attempt(request, uow, "/prices", act)


@post("/plans")
async def create_plan(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    async def act() -> str:
        body: dict[str, Any] = {
            "name": fields.get("name", ""),
            "budget_mode": fields.get("budget_mode") or "soft",
        }
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            body[name] = form_int(fields.get(name), name)
        budget = form_decimal(fields.get("monthly_budget"), "monthly_budget")
        body["monthly_budget"] = None if budget is None else str(budget)
        plan = await uow.plans.create_plan(parse(body, PlanCreate), admin)
        return f"Created plan {plan.name}."

    return await attempt(request, uow, "/prices", act)
