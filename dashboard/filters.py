"""Jinja filters for the templates: numbers, money, times and sizes, all in UTC."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from jinja2 import Environment

from billing.common import as_utc, cents, plain
from dashboard.charts import compact


def money(value: Decimal | float | int | str | None, currency: str = "usd") -> str:
    if value is None:
        return "—"
    return f"{cents(Decimal(str(value))):,} {currency.upper()}"


def price(value: Decimal | None) -> str:
    """A unit price with all its decimals but no trailing zeros."""
    return "—" if value is None else plain(Decimal(value))


def when(value: datetime | None, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return "—" if value is None else as_utc(value).strftime(fmt) + " UTC"


def day(value: datetime | None) -> str:
    return "—" if value is None else as_utc(value).strftime("%Y-%m-%d")


def iso(value: datetime | None) -> str:
    return "" if value is None else as_utc(value).isoformat()


def number(value: int | float | None) -> str:
    return "—" if value is None else f"{value:,}"


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
    "compact": compact,
    "percent": percent,
    "size": size,
}


def install(env: Environment) -> None:
    env.filters.update(FILTERS)
