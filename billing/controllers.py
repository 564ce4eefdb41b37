"""Billing's admin API under /admin/v1 (HTTP only; the logic is in services.py).

Behind the control plane's admin guard (`require_admin`): platform admins see and manage
everything; organisation admins read the price book and their own organisation's invoices
and usage, and another organisation's answer 404 exactly like missing ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any

from litestar import Controller, Request, Router, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.jobs import build_invoices, rollup_hours
from billing.models import Invoice, InvoiceLine, Price
from billing.schemas import (
    GpuPriceCreate,
    GpuPriceOut,
    InvoiceGenerate,
    InvoiceGenerateOut,
    InvoiceLineOut,
    InvoiceOut,
    ModelPriceCreate,
    ModelPriceOut,
    RollupRun,
    RollupRunOut,
)
from billing.services import (
    ExportQuery,
    PriceBook,
    as_utc,
    cents,
    export_query,
    finalize_invoice,
    get_invoice,
    invoice_number,
    list_invoices,
    month_bounds,
    parse_time,
    stream_export,
    time_range,
)
from control_plane.controllers import provide_admin, require_admin
from control_plane.models import Model
from control_plane.services import OrganizationService, Principal, record_change, snapshot
from tokenmill.errors import APIError

# --- helpers ---------------------------------------------------------------------------


def _platform_only(admin: Principal, what: str) -> None:
    if not admin.is_platform_admin:
        raise APIError(403, f"Only platform admins {what}.", code="insufficient_permissions")


async def _scope(session: AsyncSession, admin: Principal, org: str | None) -> str | None:
    """The organisation a read is confined to: the one asked for if the caller may see it
    (404 otherwise, like a missing one), else the caller's own; None (all) only for
    platform admins who name none."""
    if org is not None:
        return (await OrganizationService(session=session).visible(org, admin)).id
    if admin.is_platform_admin:
        return None
    if admin.org_id is None:  # an admin of no organisation sees no organisation's data
        raise APIError(403, "This caller belongs to no organisation.", code="insufficient_permissions")
    return admin.org_id


def _at(value: str | None) -> datetime | None:
    return None if value is None else parse_time(value, "at")


def _model_price_out(price: Price, model: Model) -> ModelPriceOut:
    return ModelPriceOut(
        id=price.id,
        model_id=model.id,
        model=model.name,
        currency=price.currency,
        input_per_mtok=price.input_per_mtok.normalize(),
        cached_input_per_mtok=price.cached_input_per_mtok.normalize(),
        output_per_mtok=price.output_per_mtok.normalize(),
        effective_from=as_utc(price.effective_from),
        created_at=as_utc(price.created_at),
    )


def _gpu_price_out(price: Price) -> GpuPriceOut:
    return GpuPriceOut(
        id=price.id,
        gpu_type=price.gpu_type or "",
        currency=price.currency,
        per_hour=price.gpu_hour.normalize(),
        effective_from=as_utc(price.effective_from),
        created_at=as_utc(price.created_at),
    )


def _plain(d: Decimal) -> Decimal:
    """Without the column's trailing zeros (Decimal('1E+3') would print in exponent form)."""
    n = d.normalize()
    return n.quantize(Decimal(1)) if n == n.to_integral_value() else n


def _line_out(line: InvoiceLine) -> InvoiceLineOut:
    return InvoiceLineOut(
        position=line.position,
        description=line.description,
        meter=line.meter,
        model=line.model,
        deployment_id=line.deployment_id or None,
        adapter=line.adapter or None,
        quantity=_plain(line.quantity),
        unit="GPU-hour" if line.meter == "gpu_seconds" else "1M tokens",
        unit_price=_plain(line.unit_price),
        amount=cents(line.amount),
    )


def _invoice_out(invoice: Invoice, *, lines: bool) -> InvoiceOut:
    return InvoiceOut(
        id=invoice.id,
        org_id=invoice.org_id,
        number=invoice_number(invoice.number),
        status=invoice.status,
        period_start=as_utc(invoice.period_start),
        period_end=as_utc(invoice.period_end),
        currency=invoice.currency,
        subtotal=cents(invoice.subtotal),
        total=cents(invoice.total),
        created_at=as_utc(invoice.created_at),
        updated_at=as_utc(invoice.updated_at),
        finalized_at=None if invoice.finalized_at is None else as_utc(invoice.finalized_at),
        lines=[_line_out(x) for x in invoice.lines] if lines else None,
    )


# --- price book ------------------------------------------------------------------------


class PriceController(Controller):
    path = "/prices"
    tags = ["Admin: billing"]

    @get("/models")
    async def list_model_prices(
        self,
        db_session: NamedDependency[AsyncSession],
        model: Annotated[str | None, QueryParameter(description="Model name or id.")] = None,
        at: Annotated[
            str | None, QueryParameter(description="Only the version in effect at this time (ISO 8601).")
        ] = None,
    ) -> list[ModelPriceOut]:
        """Every price version of every model (or one), oldest first; with `at`, the ones
        in effect then."""
        found = await PriceBook(db_session).model_prices(model_ref=model, at=_at(at))
        return [_model_price_out(p, m) for p, m in found]

    @post("/models")
    async def create_model_price(
        self,
        data: JSONBody[ModelPriceCreate],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> ModelPriceOut:
        """A new price version (history is never edited: usage keeps the price it had)."""
        _platform_only(admin, "set prices")
        price, model = await PriceBook(db_session).add_model_price(
            model_ref=data.model,
            input_per_mtok=data.input_per_mtok,
            cached_input_per_mtok=data.cached_input_per_mtok,
            output_per_mtok=data.output_per_mtok,
            currency=data.currency,
            effective_from=data.effective_from,
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return _model_price_out(price, model)

    @get("/gpus")
    async def list_gpu_prices(
        self,
        db_session: NamedDependency[AsyncSession],
        gpu_type: Annotated[str | None, QueryParameter(description="A GPU type.")] = None,
        at: Annotated[
            str | None, QueryParameter(description="Only the version in effect at this time (ISO 8601).")
        ] = None,
    ) -> list[GpuPriceOut]:
        return [
            _gpu_price_out(p) for p in await PriceBook(db_session).gpu_prices(gpu_type=gpu_type, at=_at(at))
        ]

    @post("/gpus")
    async def create_gpu_price(
        self,
        data: JSONBody[GpuPriceCreate],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> GpuPriceOut:
        _platform_only(admin, "set prices")
        price = await PriceBook(db_session).add_gpu_price(
            gpu_type=data.gpu_type,
            per_hour=data.per_hour,
            currency=data.currency,
            effective_from=data.effective_from,
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return _gpu_price_out(price)


# --- rollups and invoices --------------------------------------------------------------


class RollupController(Controller):
    path = "/rollups"
    tags = ["Admin: billing"]

    @post()
    async def run_rollups(
        self, data: JSONBody[RollupRun], admin: NamedDependency[Principal], request: Request[Any, Any, Any]
    ) -> RollupRunOut:
        """Recompute the hourly rollups of a range now (the scheduler does it hourly)."""
        _platform_only(admin, "run rollups")
        start, end = time_range(data.start, data.end)
        stats = await rollup_hours(request.app.state.sessionmaker, start, end)
        return RollupRunOut(
            start=stats.start,
            end=stats.end,
            rows=stats.rows,
            inserted=stats.inserted,
            updated=stats.updated,
            deleted=stats.deleted,
        )


class InvoiceController(Controller):
    path = "/invoices"
    tags = ["Admin: billing"]

    @get()
    async def list_invoices(
        self,
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        org: Annotated[str | None, QueryParameter(description="Organisation id or name.")] = None,
        month: Annotated[str | None, QueryParameter(description="YYYY-MM")] = None,
        status: Annotated[str | None, QueryParameter(description="draft or finalized")] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        offset: Annotated[int, QueryParameter(ge=0)] = 0,
    ) -> list[InvoiceOut]:
        """Newest period first, without their lines; organisation admins see their own."""
        org_id = await _scope(db_session, admin, org)
        found = await list_invoices(
            db_session, org_id=org_id, month=month, status=status, limit=limit, offset=offset
        )
        return [_invoice_out(i, lines=False) for i in found]

    @post("/generate", status_code=200)
    async def generate_invoices(
        self,
        data: JSONBody[InvoiceGenerate],
        admin: NamedDependency[Principal],
        request: Request[Any, Any, Any],
    ) -> InvoiceGenerateOut:
        """Create or refresh the month's drafts from the rollups (run the rollups first)."""
        _platform_only(admin, "generate invoices")
        month_bounds(data.month)  # a 400 naming `month` before any work
        build = await build_invoices(request.app.state.sessionmaker, data.month)
        return InvoiceGenerateOut(
            month=build.month,
            created=build.created,
            updated=build.updated,
            unchanged=build.unchanged,
            deleted=build.deleted,
            finalized=build.finalized,
        )

    @get("/{invoice_id:str}")
    async def get_invoice(
        self,
        invoice_id: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> InvoiceOut:
        org_id = None if admin.is_platform_admin else admin.org_id or ""
        return _invoice_out(await get_invoice(db_session, invoice_id, org_id=org_id), lines=True)

    @post("/{invoice_id:str}/finalize", status_code=200)
    async def finalize_invoice(
        self,
        invoice_id: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        force: Annotated[
            bool,
            QueryParameter(description="Finalize before the month is over (later usage goes uninvoiced)."),
        ] = False,
    ) -> InvoiceOut:
        """Freeze a draft as it stands and number it; finalizing a finalized one is a no-op."""
        if not admin.is_platform_admin:
            # Org admins learn nothing about other tenants' ids: 404 unless it is theirs.
            await get_invoice(db_session, invoice_id, org_id=admin.org_id or "")
        _platform_only(admin, "finalize invoices")
        before = snapshot(await get_invoice(db_session, invoice_id))
        invoice, changed = await finalize_invoice(db_session, invoice_id, force=force)
        if changed:
            await record_change(
                db_session,
                admin,
                "finalize",
                "invoice",
                invoice.id,
                org_id=invoice.org_id,
                before=before,
                after=invoice,
            )
        return _invoice_out(invoice, lines=True)


# --- exports ---------------------------------------------------------------------------


async def _export_chunks(
    sessionmaker: async_sessionmaker[AsyncSession], query: ExportQuery
) -> AsyncIterator[bytes]:
    # A session of its own, open while the body streams: the request's session commits and
    # closes when the handler returns, before the first byte is sent.
    async with sessionmaker() as session:
        async for chunk in stream_export(session, query):
            yield chunk


class ExportController(Controller):
    path = "/exports"
    tags = ["Admin: billing"]

    @get("/{what:str}")
    async def export(
        self,
        what: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        request: Request[Any, Any, Any],
        format: Annotated[str | None, QueryParameter(description="csv (default) or json")] = None,
        start: Annotated[
            str | None,
            QueryParameter(name="from", description="ISO 8601 date or time, UTC (default: month start)"),
        ] = None,
        end: Annotated[str | None, QueryParameter(name="to", description="Exclusive (default: now)")] = None,
        org: Annotated[str | None, QueryParameter(description="Organisation id or name")] = None,
    ) -> Stream:
        """Per-request usage, hourly rollups or invoices (with their lines) of a range, as
        CSV or JSON, streamed from a database cursor: any range in bounded memory."""
        if what not in ("usage", "rollups", "invoices"):
            raise APIError(404, f"No export '{what}': usage, rollups or invoices.", code="not_found")
        query = export_query(what, format, start, end, await _scope(db_session, admin, org))
        return Stream(
            _export_chunks(request.app.state.sessionmaker, query),
            media_type=query.media_type,
            headers={"content-disposition": f'attachment; filename="{query.filename}"'},
        )


def billing_router() -> Router:
    """Billing's admin endpoints, behind the same guard as the control plane's (a new
    Router per app, as `admin_router`)."""
    return Router(
        path="/admin/v1",
        route_handlers=[PriceController, RollupController, InvoiceController, ExportController],
        guards=[require_admin],
        dependencies={"admin": Provide(provide_admin, sync_to_thread=False)},
    )


# --- Stripe webhooks (billing/stripe_sync.py) --------------------------------------------


class StripeWebhookController(Controller):
    """`POST /webhooks/stripe`: events Stripe signs with the endpoint's secret. Outside
    /admin and without an API key, since the signature is the authentication; left out of
    the OpenAPI document, which describes the API our users call."""

    path = "/webhooks/stripe"
    include_in_schema = False

    @post("/", status_code=200)
    async def receive(self, request: Request) -> dict[str, Any]:
        # Imported here: the Stripe SDK loads only in processes that receive webhooks.
        from billing.stripe_sync import WebhookError, handle_event, verify_webhook

        secret = request.app.state.settings.stripe_webhook_secret
        if secret is None:
            # Not a 4xx: Stripe retries for days, so events wait until the secret is set.
            raise APIError(
                503,
                "Stripe webhooks are not configured: set TOKENMILL_STRIPE_WEBHOOK_SECRET.",
                code="stripe_webhooks_not_configured",
            )
        try:
            event = verify_webhook(
                await request.body(), request.headers.get("stripe-signature"), secret.get_secret_value()
            )
        except WebhookError as exc:
            raise APIError(400, f"Invalid Stripe webhook: {exc}", code="invalid_signature") from None
        result = await handle_event(request.app.state.sessionmaker, event, publisher=request.app.state.bus)
        return {"id": result.event_id, "type": result.type, "outcome": result.outcome}
