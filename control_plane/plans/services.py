"""Plans: written by platform admins, read by every admin. New limits apply to every
organisation on the plan at once (its organisations' keys are announced as changed)."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import msgspec
from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import func, select

from control_plane.audit.services import delete_recorded, record_change, snapshot
from control_plane.common import LIMITS, check_limits, flush_unique, not_found
from control_plane.common import changes as changes_of
from control_plane.events import outbox
from control_plane.orgs.models import Organization
from control_plane.plans.models import Plan
from control_plane.policy import Principal, require_platform_admin
from tokenmill.errors import APIError

if TYPE_CHECKING:
    from control_plane.plans.schemas import PlanCreate, PlanUpdate

_BUDGET_MAX = Decimal(10) ** 10  # Numeric(14, 4)


def _check_budget(budget: Decimal | None, mode: str) -> None:
    if budget is not None:
        if not budget.is_finite() or budget < 0 or budget >= _BUDGET_MAX:
            raise APIError(
                400, "monthly_budget must be a non-negative amount below 10^10.", param="monthly_budget"
            )
        exponent = budget.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -4:
            raise APIError(400, "monthly_budget has more than 4 decimal places.", param="monthly_budget")
    elif mode == "hard":
        raise APIError(400, "budget_mode 'hard' needs a monthly_budget.", param="budget_mode")


def _plan_name(raw: str) -> str:
    name = raw.strip()
    if not name:
        raise APIError(400, "Plan name must not be empty.", param="name")
    return name


class PlanService(SQLAlchemyAsyncRepositoryService[Plan]):
    class Repo(SQLAlchemyAsyncRepository[Plan]):
        model_type = Plan

    repository_type = Repo

    async def list_plans(self) -> list[Plan]:
        return list(await self.get_many(order_by=[(Plan.name, False)]))

    async def get_ref(self, plan_id: str) -> Plan:
        plan = await self.get_one_or_none(Plan.id == plan_id)
        if plan is None:
            raise not_found("plan", plan_id)
        return plan

    async def create_plan(self, data: PlanCreate, actor: Principal) -> Plan:
        require_platform_admin(actor, "create plans")
        values = msgspec.structs.asdict(data)
        values["name"] = _plan_name(values["name"])
        check_limits(values)
        _check_budget(data.monthly_budget, data.budget_mode)
        if await self.exists(name=values["name"]):
            raise APIError(409, f"A plan named '{values['name']}' already exists.", param="name")
        plan = Plan(**values)
        self.repository.session.add(plan)
        taken = f"A plan named '{values['name']}' already exists."
        await flush_unique(self.repository.session, taken, "name")
        await record_change(
            self.repository.session, actor, "create", "plan", plan.id, org_id=None, after=plan
        )
        return plan

    async def update_plan(self, plan: Plan, data: PlanUpdate, actor: Principal) -> Plan:
        require_platform_admin(actor, "change plans")
        session = self.repository.session
        changes = changes_of(data)
        if "name" in changes:
            changes["name"] = _plan_name(changes["name"])
            if changes["name"] != plan.name and await self.exists(name=changes["name"]):
                raise APIError(409, f"A plan named '{changes['name']}' already exists.", param="name")
        check_limits({f: changes.get(f, getattr(plan, f)) for f in LIMITS})
        _check_budget(
            changes.get("monthly_budget", plan.monthly_budget), changes.get("budget_mode", plan.budget_mode)
        )
        before = snapshot(plan)
        for name, value in changes.items():
            setattr(plan, name, value)
        await flush_unique(session, f"A plan named '{plan.name}' already exists.", "name")
        await record_change(session, actor, "update", "plan", plan.id, org_id=None, before=before, after=plan)
        # Gateways cache each organisation's limits with its keys: drop them all.
        for org_id in await session.scalars(select(Organization.id).where(Organization.plan_id == plan.id)):
            outbox(session).keys_changed(org_id=org_id)
        return plan

    async def delete_plan(self, plan: Plan, actor: Principal) -> None:
        require_platform_admin(actor, "delete plans")
        session = self.repository.session
        used = await session.scalar(select(func.count()).where(Organization.plan_id == plan.id))
        if used:
            raise APIError(
                409, f"{used} organisation(s) are on plan '{plan.name}'; move them first.", code="conflict"
            )
        await delete_recorded(session, actor, plan, "plan", org_id=None)
