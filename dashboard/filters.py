"""Jinja filters for the templates: numbers, money, times and sizes, all in UTC."""

from __future__ import annotations

from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from jinja2 import Environment

from billing.common import CENT, as_utc, cents, grouped, money_text, price_text
from billing.invoices.services import invoice_number
from dashboard.charts import compact

# Usage spend is exact to the billionth; under a cent, this many decimals show what it is.
SUB_CENT = Decimal("0.000001")


def money(value: Decimal | float | int | str | None, currency: str | None = "usd") -> str:
    """An amount with its currency code (None: without, as on a chart's axis), thousands
    separated, to the cent (invoices' amounts are cents already); usage spend under a cent
    with up to six decimals, not as 0.00."""
    if value is None:
        return "—"
    amount = Decimal(str(value))
    code = f" {currency.upper()}" if currency else ""
    if amount and abs(amount) < CENT:
        small = amount.quantize(SUB_CENT, rounding=ROUND_HALF_EVEN)
        return f"under {SUB_CENT}{code}" if not small else grouped(small, 2) + code
    return money_text(amount, currency) if currency else grouped(cents(amount), 2)


def price(value: Decimal | None, currency: str | None = None) -> str:
    """A unit price: thousands separated, at least to the cent and every decimal it has, with
    its currency code when given (20,000.00 USD)."""
    if value is None:
        return "—"
    return grouped(Decimal(value), 2) if currency is None else price_text(Decimal(value), currency)


def when(value: datetime | None, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return "—" if value is None else as_utc(value).strftime(fmt) + " UTC"


def day(value: datetime | None) -> str:
    return "—" if value is None else as_utc(value).strftime("%Y-%m-%d")


def iso(value: datetime | None) -> str:
    return "" if value is None else as_utc(value).isoformat()


def number(value: int | float | Decimal | None) -> str:
    if value is None:
        return "—"
    return grouped(value) if isinstance(value, Decimal) else f"{value:,}"


def invoice_label(number: int | None) -> str:
    """A finalized invoice's number, or "Draft" (numbers are given at finalization)."""
    return invoice_number(number) or "Draft"


def percent(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value * 100:.{digits}f}%"


def size(value: int | None) -> str:
    if value is None:
        return "—"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} GiB"


FILTERS: dict[str, Any] = {
    "money": money,
    "price": price,
    "when": when,
    "day": day,
    "iso": iso,
    "number": number,
    "invoice_label": invoice_label,
    "compact": compact,
    "percent": percent,
    "size": size,
}


def install(env: Environment) -> None:
    env.filters.update(FILTERS)
