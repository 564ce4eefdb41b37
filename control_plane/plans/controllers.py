"""Admin API of plans (HTTP only: the rules are the services')."""

from __future__ import annotations

from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from control_plane.plans.schemas import PlanCreate, PlanOut, PlanUpdate
from control_plane.plans.services import PlanService
from control_plane.policy import Principal
from control_plane.wire import out


class PlanController(Controller):
    path = "/plans"
    tags = ["Admin: plans"]

    @get()
    async def list_plans(self, plans: NamedDependency[PlanService]) -> list[PlanOut]:
        return [out(p, PlanOut) for p in await plans.list_plans()]

    @post()
    async def create_plan(
        self,
        data: JSONBody[PlanCreate],
        admin: NamedDependency[Principal],
        plans: NamedDependency[PlanService],
    ) -> PlanOut:
        return out(await plans.create_plan(data, admin), PlanOut)

    @get("/{plan_id:str}")
    async def get_plan(self, plan_id: FromPath[str], plans: NamedDependency[PlanService]) -> PlanOut:
        return out(await plans.get_ref(plan_id), PlanOut)

    @patch("/{plan_id:str}")
    async def update_plan(
        self,
        plan_id: FromPath[str],
        data: JSONBody[PlanUpdate],
        admin: NamedDependency[Principal],
        plans: NamedDependency[PlanService],
    ) -> PlanOut:
        """New limits and quotas apply to every organisation on the plan at once."""
        return out(await plans.update_plan(await plans.get_ref(plan_id), data, admin), PlanOut)

    @delete("/{plan_id:str}")
    async def delete_plan(
        self, plan_id: FromPath[str], admin: NamedDependency[Principal], plans: NamedDependency[PlanService]
    ) -> None:
        await plans.delete_plan(await plans.get_ref(plan_id), admin)
