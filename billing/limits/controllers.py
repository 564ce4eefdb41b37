"""Admin API of an organisation's limits against its use (HTTP only)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy.ext.asyncio import AsyncSession

from billing.limits.schemas import KeyLimitsOut, LimitsOut, OrgLimitsOut, UseOut
from billing.limits.services import LimitsReport, Use, limits_report
from control_plane.orgs.services import OrganizationService
from control_plane.plans.limits import Limits
from control_plane.policy import Principal


def limits_out(limits: Limits) -> LimitsOut:
    return LimitsOut(
        requests_per_minute=limits.requests.per_minute if limits.requests else None,
        request_burst=limits.requests.burst if limits.requests else None,
        tokens_per_minute=limits.tokens.per_minute if limits.tokens else None,
        token_burst=limits.tokens.burst if limits.tokens else None,
        max_concurrent=limits.concurrent,
    )


def _use(use: Use) -> UseOut:
    return UseOut(requests=use.requests, tokens=use.tokens)


def report_out(report: LimitsReport) -> OrgLimitsOut:
    budget = report.limits.budget
    return OrgLimitsOut(
        org_id=report.org.id,
        plan_id=report.plan.id if report.plan else None,
        plan_name=report.plan.name if report.plan else None,
        limits=limits_out(report.limits),
        monthly_budget=budget,
        budget_mode=None if budget is None else ("hard" if report.limits.hard_budget else "soft"),
        month_start=report.month_start,
        spent_this_month=report.spent,
        last_minute_from=report.since,
        last_minute_to=report.now,
        last_minute=_use(report.last_minute),
        keys=[
            KeyLimitsOut(
                id=k.key.id,
                prefix=k.key.prefix,
                name=k.key.name,
                limits=limits_out(k.limits),
                last_minute=_use(k.last_minute),
            )
            for k in report.keys
        ],
    )


class LimitsController(Controller):
    path = "/organizations/{org_id:str}/limits"
    tags = ["Admin: billing"]

    @get()
    async def get_limits(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        request: Request[Any, Any, Any],
    ) -> OrgLimitsOut:
        """The organisation's limits (its plan's, or the default tier's) and its keys' own,
        against the last minute's requests and tokens in the ledger; its monthly budget
        against this month's spend. Organisation admins: their own (404 for another)."""
        org = await OrganizationService(session=db_session).visible(org_id, admin)
        return report_out(await limits_report(db_session, org, request.app.state.settings))
