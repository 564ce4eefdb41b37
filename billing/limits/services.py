"""An organisation's limits against what it uses: its plan's limits (or the default tier's)
and its keys' own, with the last minute's requests and tokens; the monthly budget against this
month's spend, worked out as the gateway seeds its budget counter (`spend_since`: the ledger
priced as the rollups price it, dedicated deployments by GPU time).

The last minute's use comes from the ledger, not from the rate limiter: the limiter keeps
GCRA timestamps rather than counts, and in the embedded mode each process holds its own, so
the ledger is where every gateway's requests meet. It holds requests once they have ended
and been written (within seconds): requests still running, and refused ones, are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import or_
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc, month_bounds
from billing.ledger.services import UsageFilter
from billing.rollups.services import spend_since
from billing.rollups.usage import usage_by
from control_plane.common import LIMITS
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey, Organization
from control_plane.plans.limits import Limits, OrgLimits, key_limits, org_limits
from control_plane.plans.models import Plan
from tokenmill.db import utcnow
from tokenmill.settings import Settings

LAST_MINUTE = timedelta(minutes=1)


@dataclass(slots=True)
class Use:
    """Requests and tokens (prompt + completion: what the tokens limit counts once a request
    ends) in the ledger over the last minute."""

    requests: int = 0
    tokens: int = 0


@dataclass(slots=True)
class KeyLimits:
    key: ApiKey
    limits: Limits
    last_minute: Use


@dataclass(slots=True)
class LimitsReport:
    org: Organization
    plan: Plan | None  # None: the platform's default tier
    limits: OrgLimits
    now: datetime
    month_start: datetime
    spent: Decimal  # this month so far, exact (unrounded)
    last_minute: Use
    keys: list[KeyLimits] = field(default_factory=list)  # live keys with limits of their own

    @property
    def since(self) -> datetime:
        return self.now - LAST_MINUTE

    @property
    def budget_used(self) -> float | None:
        """The share of the budget spent (above 1 when over it), if there is one."""
        budget = self.limits.budget
        if budget is None:
            return None
        return float(self.spent / budget) if budget else (1.0 if self.spent else 0.0)


async def limits_report(
    session: AsyncSession, org: Organization, settings: Settings, *, now: datetime | None = None
) -> LimitsReport:
    """`org`'s limits and budget against its use (`org` one the caller may see)."""
    now = as_utc(now or utcnow())
    plan = await session.get(Plan, org.plan_id) if org.plan_id else None
    month_start = month_bounds(now)[0]
    spent = await spend_since(session, org.id, month_start)
    used = {
        g.key_id: Use(g.requests, g.tokens)
        for g in await usage_by(session, now - LAST_MINUTE, now, UsageFilter(org_id=org.id), ["key"])
    }
    keys = await ApiKeyService(session=session).get_many(
        ApiKey.org_id == org.id,
        ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        or_(*(getattr(ApiKey, name).is_not(None) for name in LIMITS)),
        order_by=[(ApiKey.created_at, False)],
    )
    return LimitsReport(
        org=org,
        plan=plan,
        limits=org_limits(plan, settings),
        now=now,
        month_start=month_start,
        spent=spent,
        last_minute=Use(sum(u.requests for u in used.values()), sum(u.tokens for u in used.values())),
        keys=[KeyLimits(k, key_limits(k), used.get(k.id, Use())) for k in keys],
    )
