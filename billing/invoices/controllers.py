"""Admin API of invoices (HTTP only: the rules are the services').

Organisation admins read their own organisation's invoices (also while it is suspended: they
pay on Stripe's hosted page, and must see what for); another organisation's answer 404
exactly like missing ones. Only platform admins generate and finalize them.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc, cents, month_bounds
from billing.invoices.pdf import PDF_MEDIA_TYPE, invoice_pdf, pdf_filename
from billing.invoices.schemas import InvoiceGenerate, InvoiceGenerateOut, InvoiceLineOut, InvoiceOut
from billing.invoices.services import finalize_invoice_as, get_invoice, invoice_number, list_invoices
from billing.jobs import build_invoices
from billing.models import Invoice, InvoiceLine
from control_plane.orgs.services import OrganizationService
from control_plane.paging import link_header, page_of
from control_plane.policy import WHILE_SUSPENDED, Principal, require_platform_admin


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


class InvoiceController(Controller):
    path = "/invoices"
    tags = ["Admin: billing"]

    @get(opt=WHILE_SUSPENDED)  # a suspended organisation's admins read what they owe
    async def list_invoices(
        self,
        request: Request[Any, Any, Any],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        org: Annotated[str | None, QueryParameter(description="Organisation id or name.")] = None,
        month: Annotated[str | None, QueryParameter(description="YYYY-MM")] = None,
        status: Annotated[str | None, QueryParameter(description="draft or finalized")] = None,
        q: Annotated[
            str | None, QueryParameter(description="Search: number, id or organisation.", max_length=200)
        ] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        after: Annotated[str | None, QueryParameter(description="Id of the previous page's last.")] = None,
        before: Annotated[str | None, QueryParameter(description="Id of the next page's first.")] = None,
        offset: Annotated[int, QueryParameter(ge=0)] = 0,
    ) -> Response[list[InvoiceOut]]:
        """Newest period first, without their lines; organisation admins see their own. The
        `Link` header names the next page (`after`) while there is one."""
        org_id = await OrganizationService(session=db_session).scope(org, admin)
        found = await list_invoices(
            db_session,
            org_id=org_id,
            month=month,
            status=status,
            page=page_of(q, limit, after, before),
            offset=offset,
        )
        return Response(
            [_invoice_out(i, lines=False) for i in found.rows], headers=link_header(str(request.url), found)
        )

    @post("/generate", status_code=200)
    async def generate_invoices(
        self,
        data: JSONBody[InvoiceGenerate],
        admin: NamedDependency[Principal],
        request: Request[Any, Any, Any],
    ) -> InvoiceGenerateOut:
        """Create or refresh the month's drafts from the rollups (run the rollups first)."""
        require_platform_admin(admin, "generate invoices")
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

    @get("/{invoice_id:str}", opt=WHILE_SUSPENDED)
    async def get_invoice(
        self,
        invoice_id: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> InvoiceOut:
        org_id = None if admin.is_platform_admin else admin.org_id or ""
        return _invoice_out(await get_invoice(db_session, invoice_id, org_id=org_id), lines=True)

    @get("/{invoice_id:str}/pdf", opt=WHILE_SUSPENDED, media_type=PDF_MEDIA_TYPE)
    async def invoice_pdf(
        self,
        invoice_id: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> Response[bytes]:
        """The invoice as a PDF: its lines, totals, currency and period, and its number once
        finalized (a draft says so, with its id)."""
        org_id = None if admin.is_platform_admin else admin.org_id or ""
        invoice = await get_invoice(db_session, invoice_id, org_id=org_id)
        return Response(
            await invoice_pdf(db_session, invoice),
            media_type=PDF_MEDIA_TYPE,
            headers={"content-disposition": f'attachment; filename="{pdf_filename(invoice)}"'},
        )

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
        invoice, _ = await finalize_invoice_as(db_session, admin, invoice_id, force=force)
        return _invoice_out(invoice, lines=True)
