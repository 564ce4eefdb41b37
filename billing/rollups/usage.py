"""Usage by model, API key and time, priced: the ledger's requests and tokens grouped per time
bucket by organisation, model name, base model and/or API key, with what they cost at the price
version in effect when they were used (the price book's `charged_price` and `units_cost`, as
the rollups price them). The rollups are per organisation and base model, so this is where the
usage breakdown, the spend of a key or a model, the keys page's activity and the limits page
come from.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import bindparam, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from billing.common import as_utc, bucket_edges, per_bucket
from billing.ledger.services import NOT_ERRORS, UsageCounts, UsageFilter
from billing.models import Price, UsageEvent
from billing.prices.services import charged_price, token_units, units_cost
from billing.rollups.services import main_currency, price_changes
from control_plane.catalog.models import Deployment, Model
from tokenmill.errors import APIError

# What `usage_by` groups by: the organisation, the model name clients used, its base model
# (what rollups and invoices are per), the API key.
USAGE_GROUPS = ("org", "model", "base_model", "key")


@dataclass(slots=True)
class UsageGroup(UsageCounts):
    """Requests, tokens, failed requests and cost of one group of ledger rows; fields it is
    not grouped by are None. `cost` is per currency (exact, unrounded); tokens not charged
    (no price, dedicated deployments) count in every total and cost nothing."""

    org_id: str | None = None
    model: str | None = None
    base_model: str | None = None
    key_id: str | None = None
    cost: dict[str, Decimal] = field(default_factory=dict)

    @classmethod
    def of(cls, key: tuple[str | None, ...]) -> UsageGroup:
        """An empty group of `key` (org, model, base model, API key)."""
        org_id, model, base_model, key_id = key
        return cls(org_id=org_id, model=model, base_model=base_model, key_id=key_id)

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion

    @property
    def key(self) -> tuple[str | None, ...]:
        return (self.org_id, self.model, self.base_model, self.key_id)

    @property
    def total_cost(self) -> Decimal:
        """All currencies together: only for ordering (never shown summed)."""
        return sum(self.cost.values(), Decimal(0))

    def add(self, other: UsageGroup) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.prompt += other.prompt
        self.cached += other.cached
        self.completion += other.completion
        for currency, amount in other.cost.items():
            self.cost[currency] = self.cost.get(currency, Decimal(0)) + amount


def _sorted(groups: Iterable[UsageGroup]) -> list[UsageGroup]:
    """Dearest first, then most tokens, then by name: the breakdown tables' order."""
    return sorted(groups, key=lambda g: (-g.total_cost, -g.tokens, -g.requests, [k or "" for k in g.key]))


def regroup(groups: Iterable[UsageGroup], by: Sequence[str]) -> list[UsageGroup]:
    """Groups merged into coarser ones (`by` a subset of what they were grouped by), dearest
    first: one query grouped by model and key gives both the per-model and the per-key table."""
    keep_org, keep_model, keep_base, keep_key = (g in by for g in USAGE_GROUPS)
    merged: dict[tuple[str | None, ...], UsageGroup] = {}
    for g in groups:
        values = (
            g.org_id if keep_org else None,
            g.model if keep_model else None,
            g.base_model if keep_base else None,
            g.key_id if keep_key else None,
        )
        target = merged.get(values)
        if target is None:
            target = merged[values] = UsageGroup.of(values)
        target.add(g)
    return _sorted(merged.values())


def _conditions(by_org: bool, by_key: bool, by_model: bool, by_keys: bool) -> list[ColumnElement[bool]]:
    """A usage filter's conditions on the ledger, with bound parameters (`_usage_params`), so
    statements are cached by which filters they have."""
    where: list[ColumnElement[bool]] = []
    if by_org:
        where.append(UsageEvent.org_id == bindparam("org_id"))
    if by_key:
        where.append(UsageEvent.api_key_id == bindparam("key_id"))
    if by_model:
        where.append(UsageEvent.model == bindparam("model"))
    if by_keys:
        where.append(UsageEvent.api_key_id.in_(bindparam("key_ids", expanding=True)))
    return where


def _usage_params(filt: UsageFilter, key_ids: Sequence[str] | None) -> dict[str, Any]:
    return {"org_id": filt.org_id, "key_id": filt.key_id, "model": filt.model, "key_ids": list(key_ids or [])}


# The ledger columns `usage_by_bucket` groups by in SQL; the base model comes from the
# deployment, looked up in Python (a join costs more than the small catalogue read).
_SQL_GROUPS = {"org": UsageEvent.org_id, "model": UsageEvent.model, "key": UsageEvent.api_key_id}


@functools.lru_cache(maxsize=128)
def _usage_stmt(
    n: int, columns: tuple[str, ...], by_org: bool, by_key: bool, by_model: bool, by_keys: bool
) -> Any:
    """One SELECT per interval (`per_bucket`) of the ledger's rows grouped by `columns`, the
    deployment and batch or not: what pricing needs. Cached by shape, as building a union of
    tens of SELECTs costs more than running it on small ranges."""
    failed = case((UsageEvent.status.in_(NOT_ERRORS), 0), else_=1)
    group = (*(_SQL_GROUPS[c] for c in columns), UsageEvent.deployment_id, UsageEvent.batch_id.is_not(None))
    where = _conditions(by_org, by_key, by_model, by_keys)

    def one(i: Any) -> Any:
        return (
            select(
                i,
                *group,
                func.count(),
                func.sum(failed),
                func.sum(UsageEvent.prompt_tokens),
                func.sum(UsageEvent.cached_tokens),
                func.sum(UsageEvent.completion_tokens),
            )
            .where(*where)
            .group_by(*group)
        )

    return per_bucket(UsageEvent.created_at, n, one)


async def usage_by_bucket(
    session: AsyncSession,
    starts: Sequence[datetime],
    end: datetime,
    filt: UsageFilter,
    group_by: Sequence[str],
    *,
    key_ids: Sequence[str] | None = None,
) -> list[list[UsageGroup]]:
    """Requests, prompt (cached included), cached and completion tokens, failed requests and
    cost of the ledger's rows matching `filt` (and of `key_ids` only, when given) in each
    bucket [starts[i], starts[i + 1]) (the last one ends at `end`), grouped by `group_by` (of
    USAGE_GROUPS), in one round trip: tokens priced at the version in effect when they were
    used, batch requests at its batch discount (as the rollups price them:
    `units_cost`, `charged_model`). Buckets are cut further at price changes, so every
    interval has one price per model. Dedicated deployments' GPU time is not here: it is per
    deployment and hour, not per request (the rollups have it)."""
    unknown = [g for g in group_by if g not in USAGE_GROUPS]
    if unknown:
        raise APIError(
            400, f"group_by takes {', '.join(USAGE_GROUPS)}, not {', '.join(unknown)}.", param="group_by"
        )
    starts, end = [as_utc(t) for t in starts], as_utc(end)
    out: list[dict[tuple[str | None, ...], UsageGroup]] = [{} for _ in starts]
    if not starts:
        return []
    changes = await price_changes(session, Price.model_id.is_not(None), starts[0], end)
    cuts = sorted({*starts, *changes})
    bucket_of = [bisect_right(starts, c) - 1 for c in cuts]
    # The moment whose price applies to an interval: the start of its stretch between changes
    # (one price lookup per model and stretch, not per interval).
    moment_of = [max([starts[0], *(x for x in changes if x <= c)]) for c in cuts]
    columns = tuple(c for c in _SQL_GROUPS if c in group_by or (c == "model" and "base_model" in group_by))
    stmt = _usage_stmt(
        len(cuts),
        columns,
        filt.org_id is not None,
        filt.key_id is not None,
        filt.model is not None,
        key_ids is not None,
    )
    params = bucket_edges(cuts, end) | _usage_params(filt, key_ids)
    deployments = {d: (m, kind) for d, m, kind in await session.execute(_DEPLOYMENTS)}
    models = {m: name for m, name in await session.execute(_MODEL_NAMES)} if "base_model" in group_by else {}
    prices: dict[tuple[str, datetime], Price | None] = {}
    units: dict[tuple[str, bool], tuple[Decimal, Decimal, Decimal]] = {}
    width = len(columns)
    org_at, model_at, key_at = (
        columns.index(c) + 1 if c in columns else None for c in ("org", "model", "key")
    )
    keep_org, keep_model, keep_base, keep_key = (g in group_by for g in ("org", "model", "base_model", "key"))
    # The price of a deployment's tokens in an interval's stretch, found once (rows are many).
    charged: dict[tuple[Any, datetime], Price | None] = {}
    for row in await session.execute(stmt, params):
        i = row[0]
        dep_id, in_batch, n, errors, prompt, cached, output = row[1 + width :]
        model_id, dep_type = deployments.get(dep_id, (None, None))
        moment = moment_of[i]
        if (dep_id, moment) not in charged:
            charged[dep_id, moment] = await charged_price(session, prices, model_id, dep_type, moment)
        price = charged[dep_id, moment]
        model = row[model_at] if model_at else None
        key = (
            row[org_at] if keep_org and org_at else None,
            model if keep_model else None,
            (models.get(model_id) or model) if keep_base else None,
            row[key_at] if keep_key and key_at else None,
        )
        bucket = out[bucket_of[i]]
        group = bucket.get(key)
        if group is None:
            group = bucket[key] = UsageGroup.of(key)
        prompt, cached, output = prompt or 0, cached or 0, output or 0
        group.requests += n
        group.errors += errors or 0
        group.prompt += prompt
        group.cached += cached
        group.completion += output
        if price is not None:
            at = (price.id, bool(in_batch))
            if at not in units:
                units[at] = token_units(price, batch=bool(in_batch))
            amount = units_cost(units[at], prompt, cached, output)
            group.cost[price.currency] = group.cost.get(price.currency, 0) + amount
    return [list(b.values()) for b in out]


_DEPLOYMENTS = select(Deployment.id, Deployment.model_id, Deployment.type)
_MODEL_NAMES = select(Model.id, Model.name)


async def usage_by(
    session: AsyncSession,
    start: datetime,
    end: datetime,
    filt: UsageFilter,
    group_by: Sequence[str],
    *,
    key_ids: Sequence[str] | None = None,
) -> list[UsageGroup]:
    """`usage_by_bucket` of the whole range [start, end) at once, dearest first."""
    return _sorted((await usage_by_bucket(session, [start], end, filt, group_by, key_ids=key_ids))[0])


def spend_of(groups: Sequence[Sequence[UsageGroup]]) -> tuple[str, list[Decimal]]:
    """The cost of each bucket's groups in the currency with most of it ("usd" when none):
    the spend per bucket of a filter the rollups cannot give."""
    per_currency: dict[str, Decimal] = {}
    for bucket in groups:
        for g in bucket:
            for currency, amount in g.cost.items():
                per_currency[currency] = per_currency.get(currency, Decimal(0)) + amount
    currency = main_currency(per_currency)
    return currency, [
        sum((g.cost.get(currency, Decimal(0)) for g in bucket), Decimal(0)) for bucket in groups
    ]


async def ledger_spend_per_bucket(
    session: AsyncSession, starts: Sequence[datetime], end: datetime, filt: UsageFilter
) -> tuple[str, list[Decimal]]:
    """What the ledger's rows matching `filt` cost in each bucket, priced as the rollups
    price them, exactly: the spend of a key or a model name, which the rollups (per
    organisation and base model) cannot give. Like `spend_per_bucket`, only in the currency
    with most of the spend, which is returned with it."""
    return spend_of(await usage_by_bucket(session, starts, end, filt, ()))
