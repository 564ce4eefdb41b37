"""What the dashboard's pages show, shaped for them: time windows cut into buckets for the
charts, and who sees which organisations.

Nothing here reads a table: the numbers come from billing's services (the ledger per
bucket and model, refused requests from the refusal counts, spend from the rollups or the
ledger priced as they price it, usage per model and key with its cost) and the control
plane's (organisations), which also hold every rule; writes go through the same services as
the admin API's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from advanced_alchemy.filters import CollectionFilter, LimitOffset, OrderBy
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc
from billing.ledger.services import UsageCounts, UsageFilter, usage_per_bucket
from billing.refusals.services import refusals_by_reason, refusals_per_bucket
from billing.rollups.services import spend_per_bucket
from billing.rollups.usage import UsageGroup, regroup, spend_of, usage_by, usage_by_bucket
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey
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
    spend: Decimal = Decimal(0)

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
    # Where spend comes from: the hourly rollups (what invoices are built from) without a key
    # or model filter; the ledger priced the same way with one (rollups are per organisation
    # and base model, not per key or client-facing name).
    spend_from: str = "rollups"
    # Refusals are counted per organisation and key, not per model name (a refused request
    # may name none, or one that does not exist), so with a model filter they are unknown.
    refusals_known: bool = True
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    totals: Bucket = field(default_factory=lambda: Bucket(datetime.fromtimestamp(0, UTC)))
    # With `detailed`: per bucket, the ledger by model name (as clients used it), base model
    # and API key, priced: what the charts stack and the breakdown tables sum.
    groups: list[list[UsageGroup]] | None = None


async def usage_series(
    session: AsyncSession, win: Window, filt: UsageFilter, *, detailed: bool = False
) -> Series:
    """Requests, tokens and errors per bucket from the ledger; refused requests from the
    gateways' refusal counts; spend per bucket from the hourly rollups (what invoices are
    built from), or, with a key or model filter, from the ledger priced as the rollups price
    it (they are per organisation and base model). With a model filter refusals are unknown.

    `detailed` reads the ledger per bucket, model name and key, priced, in one round trip
    (the usage page's charts by model and tables by model and key come from it); otherwise
    only its totals per bucket (the overview)."""
    starts = win.starts()
    filtered = filt.key_id is not None or filt.model is not None
    groups = None
    if detailed or filtered:
        groups = await usage_by_bucket(session, starts, win.end, filt, ("model", "base_model", "key"))
        counts: Sequence[UsageCounts] = [_summed(b) for b in groups]
    else:
        counts = await usage_per_bucket(session, starts, win.end, filt)
    buckets = [
        Bucket(t, c.requests, c.prompt, c.cached, c.completion, c.errors)
        for t, c in zip(starts, counts, strict=True)
    ]
    series = Series(
        win,
        buckets,
        spend_from="ledger" if filtered else "rollups",
        refusals_known=filt.model is None,
        groups=groups if detailed else None,
    )
    if series.refusals_known:
        refused = await refusals_per_bucket(session, starts, win.end, filt.org_id, filt.key_id)
        for bucket, n in zip(buckets, refused, strict=True):
            bucket.refused = n
        if any(refused):
            series.refused_by_reason = await refusals_by_reason(
                session, starts[0], win.end, filt.org_id, filt.key_id
            )
    if groups is not None and filtered:
        series.currency, spend = spend_of(groups)
    else:
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
        totals.spend += bucket.spend
    return series


def _summed(groups: Iterable[UsageGroup]) -> UsageGroup:
    total = UsageGroup()
    for g in groups:
        total.add(g)
    return total


# --- stacked by model -----------------------------------------------------------------------

# Charts stack this many models (the most tokens over the range) and "other" for the rest, so
# colours stay few enough to tell apart.
TOP_MODELS = 5
OTHER = "other models"


@dataclass(frozen=True, slots=True)
class Stacks:
    """Per bucket, the requests and tokens of each of `names` (the top models, then OTHER)."""

    names: list[str]
    requests: list[list[int]]  # [bucket][name]
    tokens: list[list[int]]


def model_stacks(series: Series, top: int = TOP_MODELS) -> Stacks | None:
    """The series' per-model counts as at most `top` models plus OTHER (None: not detailed)."""
    if series.groups is None:
        return None
    totals: dict[str, list[int]] = {}
    for bucket in series.groups:
        for g in bucket:
            total = totals.setdefault(g.model or "", [0, 0])
            total[0] += g.tokens
            total[1] += g.requests
    ranked = sorted(totals, key=lambda n: (-totals[n][0], -totals[n][1], n))
    names = ranked[:top] + ([OTHER] if len(ranked) > top else [])
    index = {n: min(i, top) for i, n in enumerate(ranked)}
    requests = [[0] * len(names) for _ in series.groups]
    tokens = [[0] * len(names) for _ in series.groups]
    for b, bucket in enumerate(series.groups):
        for g in bucket:
            requests[b][index[g.model or ""]] += g.requests
            tokens[b][index[g.model or ""]] += g.tokens
    return Stacks(names, requests, tokens)


# --- usage by model and key -----------------------------------------------------------------

# The breakdown tables list this many rows; the rest are summed in one row.
BREAKDOWN_ROWS = 25


@dataclass(slots=True)
class Breakdown:
    """The range's requests, tokens and cost per model name and per API key (the ledger,
    priced), the longest lists cut at BREAKDOWN_ROWS with the rest summed in `*_rest`."""

    by_model: list[UsageGroup]
    by_key: list[UsageGroup]
    model_rest: UsageGroup | None = None
    key_rest: UsageGroup | None = None
    rest_models: int = 0
    rest_keys: int = 0


def _cut(groups: list[UsageGroup], rows: int) -> tuple[list[UsageGroup], UsageGroup | None, int]:
    if len(groups) <= rows:
        return groups, None, 0
    return groups[:rows], _summed(groups[rows:]), len(groups) - rows


def usage_breakdown(series: Series, rows: int = BREAKDOWN_ROWS) -> Breakdown:
    """Per model (with its base model) and per key over the range, from a detailed series."""
    every = [g for bucket in series.groups or [] for g in bucket]
    by_model, model_rest, rest_models = _cut(regroup(every, ("model", "base_model")), rows)
    by_key, key_rest, rest_keys = _cut(regroup(every, ("key",)), rows)
    return Breakdown(by_model, by_key, model_rest, key_rest, rest_models, rest_keys)


async def key_activity(
    session: AsyncSession, win: Window, org_id: str, key_ids: Sequence[str]
) -> dict[str, UsageGroup]:
    """Requests, tokens and spend of each of an organisation's keys over `win`, in one query
    for all of them (keys without usage are absent)."""
    if not key_ids:
        return {}
    groups = await usage_by(
        session, win.start, win.end, UsageFilter(org_id=org_id), ("key",), key_ids=key_ids
    )
    return {g.key_id: g for g in groups if g.key_id is not None}


# The usage page's key filter lists at most this many of an organisation's keys (oldest
# first), plus those of its breakdown and the chosen one: a select of 10,000 keys is of no use.
KEY_CHOICES = 200


async def key_choices(session: AsyncSession, org_id: str, also: Sequence[str]) -> list[ApiKey]:
    """An organisation's keys to filter usage by: its first KEY_CHOICES and those of `also`
    (the ones in the breakdown, the one chosen), by name."""
    service = ApiKeyService(session=session)
    found = {
        k.id: k
        for k in await service.get_many(
            CollectionFilter("org_id", [org_id]), OrderBy("created_at", "asc"), LimitOffset(KEY_CHOICES, 0)
        )
    }
    missing = [k for k in dict.fromkeys(also) if k not in found]
    if missing:
        found |= {
            k.id: k
            for k in await service.get_many(
                CollectionFilter("id", missing), CollectionFilter("org_id", [org_id])
            )
        }
    return sorted(found.values(), key=lambda k: ((k.name or "").lower(), k.prefix))


async def key_labels(
    session: AsyncSession, known: Sequence[ApiKey], groups: Sequence[UsageGroup]
) -> dict[str, ApiKey]:
    """The API keys a breakdown names, by id: those already at hand (`known`), the rest read
    at once (a platform admin's breakdown spans organisations)."""
    labels = {k.id: k for k in known}
    missing = [g.key_id for g in groups if g.key_id and g.key_id not in labels]
    if missing:
        found = await ApiKeyService(session=session).get_many(CollectionFilter("id", missing))
        labels |= {k.id: k for k in found}
    return labels
