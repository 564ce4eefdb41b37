"""What the dashboard's pages show, shaped for them: time windows cut into buckets for the
charts, and who sees which organisations.

Nothing here reads a table: the numbers come from billing's services (the ledger per
bucket, refused requests from the refusal counts, spend from the rollups) and the control
plane's (organisations), which also hold every rule; writes go through the same services as
the admin API's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from advanced_alchemy.filters import CollectionFilter
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc
from billing.ledger.services import UsageFilter, usage_per_bucket
from billing.refusals.services import refusals_by_reason, refusals_per_bucket
from billing.rollups.services import spend_per_bucket
from control_plane.orgs.services import OrganizationService
from control_plane.policy import ACTIVE, SUSPENDED, Principal
from tokenmill.db import utcnow
from tokenmill.errors import APIError

HOUR = 3600
DAY = 86400
# The quick ranges of the overview and the usage explorer; explicit dates go up to MAX_DAYS.
PRESETS = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}
MAX_DAYS = 400


# --- who sees what --------------------------------------------------------------------------


async def org_names(session: AsyncSession, admin: Principal) -> dict[str, str]:
    """Names of the organisations `admin` may see, by id (for selects and labels)."""
    orgs = await OrganizationService(session=session).list_visible(admin)
    return {o.id: o.name for o in orgs}


async def org_statuses(session: AsyncSession, org_ids: Sequence[str] | None) -> dict[str, int]:
    """How many organisations are active and suspended (of `org_ids`, or all)."""
    orgs = OrganizationService(session=session)
    scope = [] if org_ids is None else [CollectionFilter("id", list(org_ids))]
    return {status: await orgs.count(*scope, status=status) for status in (ACTIVE, SUSPENDED)}


# --- time windows ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """[start, end) in UTC, cut into buckets of `bucket` seconds (hours or days)."""

    start: datetime
    end: datetime
    bucket: int
    preset: str | None = None

    @property
    def hourly(self) -> bool:
        return self.bucket == HOUR

    def starts(self) -> list[datetime]:
        first, last = (
            _index(self.start, self.bucket),
            _index(self.end - timedelta(microseconds=1), self.bucket),
        )
        return [datetime.fromtimestamp(i * self.bucket, UTC) for i in range(first, last + 1)]

    @property
    def from_date(self) -> str:
        return self.start.date().isoformat()

    @property
    def to_date(self) -> str:
        """The last day inside the window (the date inputs' inclusive end)."""
        return (self.end - timedelta(microseconds=1)).date().isoformat()


def _index(t: datetime, bucket: int) -> int:
    return int(as_utc(t).timestamp()) // bucket


def _parse_date(value: str, param: str) -> date:
    try:
        return date.fromisoformat(value.strip())
    except ValueError:
        raise APIError(400, f"{param} must be a date like 2026-11-01, not {value!r}.", param=param) from None


def window(
    preset: str | None, start: str | None = None, end: str | None = None, *, now: datetime | None = None
) -> Window:
    """A preset (`24h` hourly; `7d`, `30d` daily, ending with the current hour or day) or a
    range of whole UTC days from `start` to `end` inclusive (hourly up to two days)."""
    now = as_utc(now or utcnow())
    if start or end:
        lo = _parse_date(start, "from") if start else (now - timedelta(days=6)).date()
        hi = _parse_date(end, "to") if end else now.date()
        if hi < lo:
            raise APIError(400, "'to' must not be before 'from'.", param="to")
        if (hi - lo).days >= MAX_DAYS:
            raise APIError(400, f"Choose at most {MAX_DAYS} days.", param="from")
        first = datetime(lo.year, lo.month, lo.day, tzinfo=UTC)
        last = datetime(hi.year, hi.month, hi.day, tzinfo=UTC) + timedelta(days=1)
        return Window(first, last, HOUR if (last - first) <= timedelta(days=2) else DAY)
    preset = preset if preset in PRESETS else "24h"
    if preset == "24h":
        end_at = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        return Window(end_at - PRESETS[preset], end_at, HOUR, preset)
    end_at = now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    return Window(end_at - PRESETS[preset], end_at, DAY, preset)


# --- usage over time ------------------------------------------------------------------------


@dataclass(slots=True)
class Bucket:
    at: datetime
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    errors: int = 0  # answered requests that failed
    refused: int = 0  # requests refused before any worker ran them (401, 429, ...)
    spend: Decimal | None = None  # None: not known for this filter (see `usage_series`)

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion

    @property
    def error_rate(self) -> float:
        """Of every request made (answered or refused), the share that failed or was refused."""
        made = self.requests + self.refused
        return (self.errors + self.refused) / made if made else 0.0


@dataclass(slots=True)
class Series:
    window: Window
    buckets: list[Bucket]
    currency: str = "usd"
    spend_known: bool = True
    # Refusals are counted per organisation and key, not per model name (a refused request
    # may name none, or one that does not exist), so with a model filter they are unknown.
    refusals_known: bool = True
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    totals: Bucket = field(default_factory=lambda: Bucket(datetime.fromtimestamp(0, UTC)))


async def usage_series(session: AsyncSession, win: Window, filt: UsageFilter) -> Series:
    """Requests, tokens and errors per bucket from the ledger; refused requests from the
    gateways' refusal counts; spend per bucket from the hourly rollups (what invoices are
    built from). Rollups are per organisation and base model, not per key or public model
    name, so with a key or model filter spend is unknown; with a model filter, so are
    refusals."""
    starts = win.starts()
    counts = await usage_per_bucket(session, starts, win.end, filt)
    buckets = [
        Bucket(t, c.requests, c.prompt, c.cached, c.completion, c.errors)
        for t, c in zip(starts, counts, strict=True)
    ]
    series = Series(
        win,
        buckets,
        spend_known=filt.key_id is None and filt.model is None,
        refusals_known=filt.model is None,
    )
    if series.refusals_known:
        refused = await refusals_per_bucket(session, starts, win.end, filt.org_id, filt.key_id)
        for bucket, n in zip(buckets, refused, strict=True):
            bucket.refused = n
        if any(refused):
            series.refused_by_reason = await refusals_by_reason(
                session, starts[0], win.end, filt.org_id, filt.key_id
            )
    if series.spend_known:
        series.currency, spend = await spend_per_bucket(session, starts, win.end, filt.org_id)
        for bucket, amount in zip(buckets, spend, strict=True):
            bucket.spend = amount
    totals = series.totals
    for bucket in series.buckets:
        totals.requests += bucket.requests
        totals.prompt += bucket.prompt
        totals.cached += bucket.cached
        totals.completion += bucket.completion
        totals.errors += bucket.errors
        totals.refused += bucket.refused
        if bucket.spend is not None:
            totals.spend = (totals.spend or Decimal(0)) + bucket.spend
    return series
