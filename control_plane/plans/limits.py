"""Which limits apply: an organisation's (its plan's, or the platform's default tier without
one) and a key's own. One rule, read by the gateway when it admits a request
(gateway/keys.py) and by what shows the limits (billing/limits, the dashboard's Limits page)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from control_plane.orgs.models import ApiKey
from control_plane.plans.models import Plan
from tokenmill.settings import Settings


@dataclass(slots=True, frozen=True)
class Rate:
    """`per_minute` units a minute, at most `burst` at once (GCRA capacity)."""

    per_minute: int
    burst: int


def rate(per_minute: int | None, burst: int | None) -> Rate | None:
    """None (no limit) for 0 or None; a burst of a whole minute unless one is set."""
    if not per_minute:
        return None
    return Rate(per_minute, burst or per_minute)


@dataclass(slots=True, frozen=True)
class Limits:
    """Requests and tokens a minute, concurrent requests; None: no limit."""

    requests: Rate | None = None
    tokens: Rate | None = None
    concurrent: int | None = None

    @property
    def any(self) -> bool:
        return self.requests is not None or self.tokens is not None or self.concurrent is not None


@dataclass(slots=True, frozen=True)
class OrgLimits(Limits):
    budget: Decimal | None = None  # monthly spend limit
    hard_budget: bool = False  # refuse what would overshoot it, rather than only alert


def org_limits(plan: Plan | None, settings: Settings) -> OrgLimits:
    """An organisation's limits: its plan's, or without one the default tier's (settings)."""
    if plan is None:
        return OrgLimits(
            rate(settings.default_requests_per_minute, None),
            rate(settings.default_tokens_per_minute, None),
            settings.default_max_concurrent or None,
        )
    return OrgLimits(
        rate(plan.requests_per_minute, plan.request_burst),
        rate(plan.tokens_per_minute, plan.token_burst),
        plan.max_concurrent,
        plan.monthly_budget,
        plan.budget_mode == "hard",
    )


def key_limits(key: ApiKey) -> Limits:
    """A key's own limits, which apply on top of its organisation's."""
    return Limits(
        rate(key.requests_per_minute, key.request_burst),
        rate(key.tokens_per_minute, key.token_burst),
        key.max_concurrent,
    )
