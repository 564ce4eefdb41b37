"""The dashboard's invoice, price and plan pages (HTTP only: reads and writes go through
billing's and the control plane's services); the usage pages are in usage_pages.py.

An invoice's downloads are billing's exports (billing/exports/services.py): the same files as
the admin API's `GET /admin/v1/exports/...`; its PDF is the admin API's
`GET /admin/v1/invoices/{id}/pdf` (billing/invoices/pdf.py). Running rollups, generating
invoices and finalizing one call the jobs and services the admin API's billing endpoints
call, for platform admins only."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc, time_range
from billing.exports.services import invoice_document
from billing.invoices.pdf import PDF_MEDIA_TYPE, invoice_pdf, pdf_filename
from billing.invoices.services import finalize_invoice_as, get_invoice, invoice_number, list_invoices
from billing.jobs import build_invoices, rollup_hours
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
from dashboard.filters import money, when
from dashboard.lists import Pager, list_query
from dashboard.services import (
    org_names,
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

# --- invoices -------------------------------------------------------------------------------


@get("/invoices", opt=WHILE_SUSPENDED)
async def invoices(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    month: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await uow.orgs.scope(org, admin)
    query = list_query(q, after, before)
    found = await list_invoices(
        uow.session, org_id=org_id, month=month or None, status=status or None, page=query
    )
    params = {"org": org or "", "month": month or "", "status": status or ""}
    return page(
        request,
        "invoices.html",
        title="Invoices",
        current="invoices",
        invoices=found.rows,
        pager=Pager("/invoices", query, found, "invoices", params),
        orgs=await org_names(uow.session, admin),
        params=params,
        this_month=f"{datetime.now(UTC):%Y-%m}",
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
        title=f"Invoice {invoice_number(found.number) or found.id}",
        current="invoices",
        invoice=found,
        org_name=(await org_names(uow.session, admin)).get(found.org_id, found.org_id),
        # A month still running is finalized only on purpose (`force`): see finalize_invoice.
        period_over=as_utc(found.period_end) <= datetime.now(UTC),
    )


@get("/invoices/{invoice_id:str}/download/{fmt:str}", opt=WHILE_SUSPENDED)
async def invoice_download(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    invoice_id: FromPath[str],
    fmt: FromPath[str],
) -> Response[bytes]:
    found = await _invoice(uow.session, admin_of(request), invoice_id)
    if fmt == "pdf":
        body, media, name = await invoice_pdf(uow.session, found), PDF_MEDIA_TYPE, pdf_filename(found)
    elif fmt in ("csv", "json"):
        body = await invoice_document(uow.session, found, fmt)
        media = "text/csv; charset=utf-8" if fmt == "csv" else "application/json"
        name = f"invoice-{found.id}.{fmt}"
    else:
        raise APIError(404, "Download as pdf, csv or json.")
    return Response(body, media_type=media, headers={"content-disposition": f'attachment; filename="{name}"'})


# --- billing runs (platform admins) ---------------------------------------------------------


@post("/rollups")
async def run_rollups(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    """`POST /admin/v1/rollups`'s job: recompute the hourly rollups of a range now."""
    require_platform_admin(admin_of(request), "run rollups")  # anyone else: a 403 page
    fields = await form_fields(request)

    async def act() -> str:
        start, end = time_range(fields.get("from") or None, fields.get("to") or None)
        stats = await rollup_hours(request.app.state.sessionmaker, start, end)
        return (
            f"Rollups of {when(stats.start)} to {when(stats.end)}: {stats.rows:,} rows "
            f"({stats.inserted:,} new, {stats.updated:,} changed, {stats.deleted:,} removed)."
        )

    return await attempt(request, uow, "/invoices", act)


@post("/invoices/generate")
async def generate_invoices(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    """`POST /admin/v1/invoices/generate`'s job: the month's drafts from its rollups."""
    require_platform_admin(admin_of(request), "generate invoices")
    fields = await form_fields(request)
    month = fields.get("month", "")

    async def act() -> str:
        build = await build_invoices(request.app.state.sessionmaker, month)
        counts = (
            (build.created, "new"),
            (build.updated, "updated"),
            (build.unchanged, "unchanged"),
            (build.deleted, "removed (no usage left)"),
            (build.finalized, "finalized, left as they are"),
        )
        said = ", ".join(f"{len(ids)} {what}" for ids, what in counts if ids)
        return f"Invoices of {build.month}: {said or 'no usage with a price, so no invoices'}."

    return await attempt(request, uow, "/invoices", act)


@post("/invoices/{invoice_id:str}/finalize")
async def finalize_draft(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], invoice_id: FromPath[str]
) -> Redirect:
    """`POST /admin/v1/invoices/{id}/finalize`: number the draft and freeze it, audited."""
    admin = admin_of(request)
    await _invoice(uow.session, admin, invoice_id)  # another organisation's: a 404 page
    require_platform_admin(admin, "finalize invoices")
    fields = await form_fields(request)

    async def act() -> str:
        found, changed = await finalize_invoice_as(
            uow.session, admin, invoice_id, force=fields.get("force") == "yes"
        )
        number = invoice_number(found.number)
        if not changed:
            return f"Invoice {found.id} was already finalized as {number}."
        return f"Finalized invoice {found.id} as {number}, total {money(found.total, found.currency)}."

    return await attempt(request, uow, f"/invoices/{invoice_id}", act)


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
            batch_discount=form_decimal(fields.get("batch_discount"), "batch_discount"),
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
