"""An invoice as a PDF: what a customer files and forwards, with the same lines and totals as
the invoice's page, CSV and JSON. The dashboard's download and the admin API's
`GET /admin/v1/invoices/{id}/pdf` both come from here.

Laid out with reportlab's platypus in a worker thread (a long invoice is CPU work that must
not hold the event loop), in the TrueType font reportlab ships, embedded, so any name an
organisation chose prints (a character the font lacks prints as a box, never an error).
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from xml.sax.saxutils import escape

from reportlab.lib import colors
from reportlab.lib.enums import TA_RIGHT
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import ParagraphStyle
from reportlab.lib.units import mm
from reportlab.pdfbase import pdfmetrics
from reportlab.pdfbase.ttfonts import TTFont
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc, grouped, money_text, price_text
from billing.invoices.services import invoice_number
from billing.models import Invoice
from control_plane.orgs.models import Organization

PDF_MEDIA_TYPE = "application/pdf"


@dataclass(frozen=True, slots=True)
class PdfLine:
    description: str
    quantity: str
    unit_price: str
    amount: str


@dataclass(frozen=True, slots=True)
class PdfInvoice:
    """What the document shows, as text: taken from the ORM rows before leaving the loop."""

    title: str
    facts: tuple[tuple[str, str], ...]
    lines: tuple[PdfLine, ...]
    subtotal: str
    total: str
    note: str


def pdf_invoice(invoice: Invoice, org_name: str) -> PdfInvoice:
    number = invoice_number(invoice.number)
    currency = invoice.currency.upper()
    last_day = as_utc(invoice.period_end) - timedelta(days=1)  # the period's end is exclusive
    facts = [
        ("Invoice number", number or "Draft (numbered when finalized)"),
        ("Invoice id", invoice.id),
        ("Status", "Finalized" if number else "Draft"),
        ("Billed to", f"{org_name} ({invoice.org_id})"),
        ("Period", f"{_day(invoice.period_start)} to {_day(last_day)} (UTC)"),
        ("Currency", currency),
    ]
    if invoice.finalized_at is not None:
        facts.append(("Finalized", f"{as_utc(invoice.finalized_at):%Y-%m-%d %H:%M} UTC"))
    lines = tuple(
        PdfLine(
            description=line.description,
            quantity=f"{grouped(line.quantity)} {'GPU-seconds' if line.meter == 'gpu_seconds' else 'tokens'}",
            unit_price=f"{price_text(line.unit_price, currency)} per "
            + ("GPU-hour" if line.meter == "gpu_seconds" else "1M tokens"),
            amount=money_text(line.amount, currency),
        )
        for line in invoice.lines
    )
    return PdfInvoice(
        title=f"Invoice {number}" if number else f"Draft invoice {invoice.id}",
        facts=tuple(facts),
        lines=lines,
        subtotal=money_text(invoice.subtotal, currency),
        total=money_text(invoice.total, currency),
        note=(
            "Each line is rounded half-even to the cent."
            if number
            else "This is a draft: its lines change with usage until it is finalized and numbered."
        ),
    )


def _day(t: datetime) -> str:
    return f"{as_utc(t):%Y-%m-%d}"


@cache
def _font() -> tuple[str, str]:
    """reportlab's bundled Bitstream Vera, registered once per process."""
    pdfmetrics.registerFont(TTFont("Vera", "Vera.ttf"))
    pdfmetrics.registerFont(TTFont("Vera-Bold", "VeraBd.ttf"))
    return "Vera", "Vera-Bold"


def render_invoice_pdf(doc: PdfInvoice) -> bytes:
    regular, bold = _font()
    body = ParagraphStyle("body", fontName=regular, fontSize=9, leading=12)
    right = ParagraphStyle("right", parent=body, alignment=TA_RIGHT)
    head = ParagraphStyle("head", parent=body, fontName=bold)
    head_right = ParagraphStyle("head-right", parent=head, alignment=TA_RIGHT)
    title = ParagraphStyle("title", fontName=bold, fontSize=18, leading=22, spaceAfter=6 * mm)

    def p(text: str, style: ParagraphStyle = body) -> Paragraph:
        return Paragraph(escape(text), style)

    facts = Table(
        [[p(k, head), p(v)] for k, v in doc.facts],
        colWidths=[38 * mm, None],
        hAlign="LEFT",
        style=TableStyle([("VALIGN", (0, 0), (-1, -1), "TOP"), ("LEFTPADDING", (0, 0), (-1, -1), 0)]),
    )
    rows: list[list[Paragraph | str]] = [
        [
            p("Description", head),
            p("Quantity", head_right),
            p("Unit price", head_right),
            p("Amount", head_right),
        ]
    ]
    rows += [
        [p(x.description), p(x.quantity, right), p(x.unit_price, right), p(x.amount, right)]
        for x in doc.lines
    ]
    if not doc.lines:
        rows.append([p("No usage in this period."), "", "", ""])
    rows.append(["", "", p("Subtotal", head_right), p(doc.subtotal, right)])
    rows.append(["", "", p("Total", head_right), p(doc.total, head_right)])
    lines = Table(
        rows,
        colWidths=[None, 32 * mm, 44 * mm, 34 * mm],
        repeatRows=1,
        style=TableStyle(
            [
                ("VALIGN", (0, 0), (-1, -1), "TOP"),
                ("LINEBELOW", (0, 0), (-1, 0), 0.8, colors.black),
                ("LINEBELOW", (0, 1), (-1, -4), 0.25, colors.lightgrey),
                ("LINEABOVE", (2, -2), (-1, -2), 0.8, colors.black),
            ]
        ),
    )
    out = io.BytesIO()
    # invariant: no creation time or random id inside, so the same invoice is the same file.
    pdf = SimpleDocTemplate(
        out,
        pagesize=A4,
        title=doc.title,
        author="Tokenmill",
        leftMargin=18 * mm,
        rightMargin=18 * mm,
        topMargin=18 * mm,
        bottomMargin=18 * mm,
        invariant=1,
    )
    pdf.build([p(doc.title, title), facts, Spacer(1, 8 * mm), lines, Spacer(1, 6 * mm), p(doc.note)])
    return out.getvalue()


async def invoice_pdf(session: AsyncSession, invoice: Invoice) -> bytes:
    """The PDF of an invoice loaded with its lines (`get_invoice`)."""
    org_name = await session.scalar(select(Organization.name).where(Organization.id == invoice.org_id))
    doc = pdf_invoice(invoice, org_name or invoice.org_id)
    return await asyncio.to_thread(render_invoice_pdf, doc)


def pdf_filename(invoice: Invoice) -> str:
    return f"invoice-{invoice_number(invoice.number) or invoice.id}.pdf"
