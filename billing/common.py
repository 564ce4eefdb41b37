"""What every part of billing shares: units, times in UTC, the dialect's upsert, how exact
numbers are written, and time buckets in SQL. One definition each, used by all."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import bindparam, literal_column, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from billing.models import METERS
from tokenmill.db import utcnow
from tokenmill.errors import APIError

MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)
CENT = Decimal("0.01")
BILLIONTH = Decimal("1e-9")  # of a currency unit: the precision of prices and stored costs
HOUR = timedelta(hours=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The meters counted in tokens (online and batch); the rest is GPU time.
TOKEN_METERS = tuple(m for m in METERS if m != "gpu_seconds")
# What one unit price is per: a million tokens, or an hour of GPU time.
PER = {m: MILLION for m in TOKEN_METERS} | {"gpu_seconds": SECONDS_PER_HOUR}


# --- time -------------------------------------------------------------------------------


def as_utc(t: datetime) -> datetime:
    """Naive times are UTC (as the database stores them)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def floor_hour(t: datetime) -> datetime:
    return as_utc(t).replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: datetime) -> datetime:
    floor = floor_hour(t)
    return floor if floor == as_utc(t) else floor + HOUR


def month_bounds(month: date | datetime | str) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of a UTC calendar month, given as a
    date or time in it, or as `YYYY-MM`. A malformed string is a 400 naming `month`."""
    if isinstance(month, str):
        m = re.fullmatch(r"(\d{4})-(\d{2})(?:-01)?", month.strip())
        if m is None or not 1 <= int(m.group(2)) <= 12:
            raise APIError(400, f"month must look like 2026-11, not {month!r}.", param="month")
        year, mon = int(m.group(1)), int(m.group(2))
    elif isinstance(month, datetime):
        t = as_utc(month)
        year, mon = t.year, t.month
    else:
        year, mon = month.year, month.month
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=UTC)
    return start, end


def parse_time(value: str, param: str) -> datetime:
    """A time parameter: `2026-11-01T12:00:00Z`, `2026-11-01` (midnight) or `2026-11` (the
    month's start); naive means UTC. Anything else is a 400 naming `param`."""
    text = value.strip()
    if re.fullmatch(r"\d{4}-\d{2}", text):
        try:
            return month_bounds(text)[0]
        except APIError:
            pass
    else:
        try:
            return as_utc(datetime.fromisoformat(text.replace("z", "Z")))
        except ValueError:
            pass
    raise APIError(
        400,
        f"{param} must be an ISO 8601 date or time (e.g. 2026-11-01 or 2026-11-01T00:00:00Z), not {value!r}.",
        param=param,
    )


def time_range(
    start: str | None,
    end: str | None,
    *,
    now: datetime | None = None,
    names: tuple[str, str] = ("from", "to"),
) -> tuple[datetime, datetime]:
    """A [start, end) range from optional parameters: by default this month so far."""
    now = now or utcnow()
    lo = parse_time(start, names[0]) if start else month_bounds(now)[0]
    hi = parse_time(end, names[1]) if end else now
    if hi <= lo:
        raise APIError(400, f"{names[1]} must be after {names[0]}.", param=names[1])
    return lo, hi


def iso(t: datetime | None) -> str | None:
    """A time as exports write it: ISO 8601 in UTC with a `Z`."""
    return None if t is None else as_utc(t).isoformat().replace("+00:00", "Z")


# --- numbers ----------------------------------------------------------------------------


def plain(d: Decimal) -> str:
    """A quantity or price without the column's trailing zeros, never in exponent form (how
    exports and Stripe both read numbers)."""
    text = format(d.normalize(), "f")
    return "0" if text in ("-0", "") else text


def cents(amount: Decimal) -> Decimal:
    """The one rounding of the money rules: half-even to the cent."""
    return amount.quantize(CENT, rounding=ROUND_HALF_EVEN)


def grouped(d: Decimal, places: int = 0) -> str:
    """Thousands separated, with at least `places` decimals and every further one it has:
    `grouped(Decimal("20000"), 2)` is 20,000.00, `grouped(Decimal("0.0375"), 2)` 0.0375."""
    d = d.normalize() if d else Decimal(0)  # never -0
    if -int(d.as_tuple().exponent) < places:
        d = d.quantize(Decimal(1).scaleb(-places))
    return f"{d:,f}"


def money_text(amount: Decimal, currency: str) -> str:
    """An amount as invoices show it: to the cent, with its currency code (1,234.50 USD)."""
    return f"{grouped(cents(amount), 2)} {currency.upper()}"


def price_text(price: Decimal, currency: str) -> str:
    """A unit price: at least to the cent, every decimal it has (20,000.00 USD, 0.0375 USD)."""
    return f"{grouped(price, 2)} {currency.upper()}"


# --- SQL ----------------------------------------------------------------------------------


def dialect(session: AsyncSession) -> str:
    return session.get_bind().dialect.name


def dialect_insert(session: AsyncSession) -> Any:
    """The dialect's INSERT, which has ON CONFLICT (both PostgreSQL and SQLite)."""
    return postgresql.insert if dialect(session) == "postgresql" else sqlite.insert


def per_bucket(column: Any, n: int, make: Callable[[Any], Any]) -> Any:
    """One SELECT per time bucket, each a range scan of `column`'s index between the
    parameters `lo<i>` and `hi<i>` (`bucket_edges`), as one UNION ALL statement (one round
    trip); `make(i)` builds the bucket's SELECT around its index column `i`. Unlike GROUP BY
    on an expression of the time, this sorts nothing: on 100,000 ledger rows it is about
    three times faster on SQLite and no slower on PostgreSQL (bench/dashboard.py)."""
    parts = [
        make(literal_column(str(i)).label("i")).where(
            column >= bindparam(f"lo{i}", type_=column.type), column < bindparam(f"hi{i}", type_=column.type)
        )
        for i in range(n)
    ]
    return parts[0] if n == 1 else union_all(*parts)


def bucket_edges(starts: Sequence[datetime], end: datetime) -> dict[str, datetime]:
    """The `lo<i>`/`hi<i>` parameters of a `per_bucket` statement: bucket i is
    [starts[i], starts[i + 1]), the last one ends at `end`."""
    edges = [*starts, end]
    return {f"lo{i}": lo for i, lo in enumerate(edges[:-1])} | {
        f"hi{i}": hi for i, hi in enumerate(edges[1:])
    }
