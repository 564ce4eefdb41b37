"""Deployments: the shared serverless ones (platform admins) and organisations' dedicated ones.

The rules of a dedicated deployment, whoever asks (admin API, dashboard, CLI): its GPU type
is in the price book (it is billed by GPU-hour), it fits its organisation's quotas (replicas,
and GPUs: `gpus_per_replica` x `max_replicas`), its name is unique in its organisation and no
serverless model's, and it runs only while its organisation is not suspended (a suspension
holds it at zero replicas, `hold_deployments`). Every deployment's engine, engine arguments and
GPUs per replica follow catalog/engines.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import Select, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from control_plane.audit.services import delete_recorded, record_change, snapshot
from control_plane.catalog.config import CatalogConfig
from control_plane.catalog.engines import choose_engine
from control_plane.catalog.models import ACTIVE, STOPPED, SUSPENDED, VLLM, Adapter, Deployment, Model, Worker
from control_plane.catalog.services import model_ref
from control_plane.common import changes as changes_of
from control_plane.common import flush_unique, not_found
from control_plane.orgs.models import Organization
from control_plane.paging import Page, PageQuery, contains, keyset_page
from control_plane.plans.models import Plan
from control_plane.policy import (
    Principal,
    check_dedicated_quota,
    check_deployable,
    org_scope,
    require_platform_admin,
    require_visible_org,
)
from tokenmill.errors import APIError

if TYPE_CHECKING:
    from control_plane.catalog.schemas import Autoscaling, DeploymentCreate, DeploymentUpdate


def _footprint(dep: Deployment) -> tuple[int, int]:
    """(replicas, GPUs) a deployment may take at most, against its organisation's quotas; a
    stopped one takes nothing, a suspended one keeps its place for when it resumes."""
    if dep.status == STOPPED:
        return 0, 0
    return dep.max_replicas, dep.max_replicas * dep.gpus_per_replica


def _check_autoscaling(scaling: Autoscaling | None) -> None:
    """Settings that only work with a target rate are refused without one, rather than ignored."""
    if scaling is None or scaling.target_rate is not None:
        return
    for name in ("drain_time_seconds", "forecast", "forecast_lead_seconds"):
        if getattr(scaling, name) not in (None, False):
            raise APIError(
                400,
                f"autoscaling.{name} works from the arrival rate: set autoscaling.target_rate "
                "(requests per second one replica should take) too.",
                param=f"autoscaling.{name}",
            )


def _check_replicas(low: int, high: int) -> None:
    if high < 1:
        raise APIError(400, "max_replicas must be at least 1.", param="max_replicas")
    if low > high:
        raise APIError(400, f"min_replicas ({low}) exceeds max_replicas ({high}).", param="min_replicas")


async def _check_adapters(
    session: AsyncSession, ids: list[str], org_id: str | None, model_id: str
) -> list[str]:
    """Adapter ids pinned to a deployment: each the owner's own, on the same base model."""
    if len(set(ids)) != len(ids):
        raise APIError(400, "adapters lists an adapter twice.", param="adapters")
    for adapter_id in ids:
        adapter = await session.get(Adapter, adapter_id)
        # Another organisation's adapter reads exactly like a missing one.
        if adapter is None or adapter.org_id != org_id:
            raise APIError(400, f"No adapter '{adapter_id}' in this organisation.", param="adapters")
        if adapter.model_id != model_id:
            raise APIError(
                400,
                f"Adapter '{adapter_id}' is for another base model than the deployment's.",
                param="adapters",
            )
    return ids


def _with_config(dep: Deployment, key: str, value: Any) -> None:
    # A new dict, so SQLAlchemy sees the JSON column change.
    config = {k: v for k, v in (dep.config or {}).items() if k != key}
    if value:
        config[key] = value
    dep.config = config or None


async def hold_deployments(session: AsyncSession, org_id: str, *, hold: bool, actor: Principal) -> None:
    """Suspend (`hold`) an organisation's active deployments, which the reconciler then holds
    at zero replicas, or resume the ones a suspension held, with the replicas they had.
    Deployments an admin stopped stay stopped either way."""
    old, new = (ACTIVE, SUSPENDED) if hold else (SUSPENDED, ACTIVE)
    held = select(Deployment).where(Deployment.org_id == org_id, Deployment.status == old)
    for dep in list(await session.scalars(held)):
        before = snapshot(dep)
        dep.status = new
        await session.flush()
        action = "suspend" if hold else "resume"
        await record_change(
            session, actor, action, "deployment", dep.id, org_id=org_id, before=before, after=dep
        )


class DeploymentService(SQLAlchemyAsyncRepositoryService[Deployment]):
    class Repo(SQLAlchemyAsyncRepository[Deployment]):
        model_type = Deployment

    repository_type = Repo

    def __init__(self, session: AsyncSession, *, config: CatalogConfig, **kwargs: Any) -> None:
        super().__init__(session=session, **kwargs)
        self.config = config

    def _visible_stmt(self, actor: Principal, org_id: str | None) -> Select[tuple[Deployment]]:
        query = select(Deployment)
        if org_id is not None:
            require_visible_org(actor, org_id)
            query = query.where(Deployment.org_id == org_id)
        elif (scope := org_scope(actor)) is not None:
            query = query.where(or_(Deployment.org_id.is_(None), Deployment.org_id == scope))
        return query

    async def list_visible(self, actor: Principal, org_id: str | None = None) -> list[Deployment]:
        """Serverless deployments and the dedicated ones `actor` may see (of `org_id` only,
        when given)."""
        query = self._visible_stmt(actor, org_id).order_by(Deployment.name)
        return list(await self.repository.session.scalars(query))

    async def page_visible(
        self, actor: Principal, query: PageQuery, org_id: str | None = None
    ) -> Page[Deployment]:
        """A page of `list_visible` by name, searched by name and base model name."""
        models = select(Model.id)

        def search(text: str) -> ColumnElement[bool]:
            return or_(
                contains(Deployment.name, text),
                Deployment.model_id.in_(models.where(contains(Model.name, text))),
            )

        return await keyset_page(
            self.repository.session,
            self._visible_stmt(actor, org_id),
            query,
            by=[(Deployment.name, False), (Deployment.id, False)],
            search=search,
        )

    async def visible(self, dep_id: str, actor: Principal) -> Deployment:
        dep = await self.get_one_or_none(Deployment.id == dep_id)
        # Serverless deployments are everyone's to read; dedicated ones their owner's.
        if dep is None or (dep.org_id is not None and not actor.sees(dep.org_id)):
            raise not_found("deployment", dep_id)
        return dep

    def _may_change(self, dep: Deployment, actor: Principal) -> None:
        if dep.org_id is None:
            require_platform_admin(actor, "change serverless deployments")

    async def create_deployment(self, data: DeploymentCreate, actor: Principal) -> Deployment:
        session = self.repository.session
        model = await model_ref(session, data.model)
        org: Organization | None = None
        if data.type == "serverless":
            require_platform_admin(actor, "create serverless deployments", "type")
            if data.org_id is not None:
                raise APIError(400, "A serverless deployment is shared; it has no org_id.", param="org_id")
            if data.adapters:
                raise APIError(
                    400,
                    "Serverless deployments serve every organisation's own adapters by name; "
                    "adapters can only be pinned to a dedicated deployment.",
                    param="adapters",
                )
        else:
            org_id = data.org_id if data.org_id is not None else org_scope(actor)
            if org_id is None:
                raise APIError(400, "A dedicated deployment needs the org_id that owns it.", param="org_id")
            org = await session.get(Organization, org_id) if actor.sees(org_id) else None
            if org is None:
                raise APIError(404, f"No organisation '{org_id}'.", code="not_found", param="org_id")
        org_id = org.id if org is not None else None
        _check_replicas(data.min_replicas, data.max_replicas)
        _check_autoscaling(data.autoscaling)
        await self._check_name(data.name, org_id)
        adapters = await _check_adapters(session, data.adapters, org_id, model.id)
        config: dict[str, Any] = {"adapters": adapters} if adapters else {}
        if data.autoscaling is not None and (scaling := msgspec.to_builtins(data.autoscaling)):
            config["autoscaling"] = scaling
        engine = choose_engine(
            data.engine,
            data.engine_args,
            data.gpus_per_replica,
            gpu_type=data.gpu_type,
            kind=model.kind,
            context_length=model.context_length,
        )
        dep = Deployment(
            name=data.name,
            model_id=model.id,
            org_id=org_id,
            kind=model.kind,
            type=data.type,
            gpu_type=data.gpu_type,
            min_replicas=data.min_replicas,
            max_replicas=data.max_replicas,
            status=data.status,
            config=config or None,
            engine=engine.engine,
            engine_args=engine.engine_args,
            gpus_per_replica=engine.gpus_per_replica,
        )
        if org is not None:
            await self._check_gpu_type(data.gpu_type)
            await self._check_dedicated(org, dep, before=(0, 0))
        session.add(dep)
        await flush_unique(session, f"A deployment named '{data.name}' already exists.", "name")
        await record_change(session, actor, "create", "deployment", dep.id, org_id=org_id, after=dep)
        return dep

    async def _check_name(self, name: str, org_id: str | None) -> None:
        """Clients name deployments and adapters alike as `model`: a name must mean one thing
        to every organisation that can see it, and reveal nothing of the others'."""
        session = self.repository.session
        serverless = select(Deployment.id).where(Deployment.name == name, Deployment.org_id.is_(None))
        if org_id is None:
            if await session.scalar(serverless.limit(1)) is not None:
                raise APIError(409, f"A deployment named '{name}' already exists.", param="name")
            # Platform admins see every organisation: a shared name would shadow a tenant's.
            dedicated = select(Deployment.id).where(Deployment.name == name, Deployment.org_id.is_not(None))
            if await session.scalar(dedicated.limit(1)) is not None:
                raise APIError(409, f"An organisation has a deployment named '{name}'.", param="name")
        else:
            own = select(Deployment.id).where(Deployment.name == name, Deployment.org_id == org_id)
            if await session.scalar(own.limit(1)) is not None:
                raise APIError(409, f"A deployment named '{name}' already exists.", param="name")
            if await session.scalar(serverless.limit(1)) is not None:
                raise APIError(
                    409,
                    f"'{name}' is a serverless model every organisation sees; pick another name.",
                    param="name",
                )
        # A deployment would hide an adapter of the same name from its organisation (or, if
        # serverless, from every one).
        clash = select(Adapter.id).where(Adapter.name == name)
        if org_id is not None:
            clash = clash.where(Adapter.org_id == org_id)
        if await session.scalar(clash.limit(1)) is not None:
            raise APIError(409, f"An adapter named '{name}' already exists.", param="name")

    async def _check_gpu_type(self, gpu_type: str | None) -> None:
        """A dedicated deployment is billed by the GPU-hour of its GPU type: one without a
        price would run for free."""
        if gpu_type is None:
            raise APIError(
                400,
                "A dedicated deployment needs a gpu_type from the price book (it is billed by GPU-hour).",
                param="gpu_type",
            )
        if not await self.config.gpu_priced(self.repository.session, gpu_type):
            raise APIError(
                400,
                f"GPU type '{gpu_type}' has no price in the price book; add one first "
                "(POST /admin/v1/prices/gpus).",
                param="gpu_type",
            )

    async def _check_dedicated(self, org: Organization, dep: Deployment, *, before: tuple[int, int]) -> None:
        """A dedicated deployment as it is about to be written: not run while its organisation
        is suspended, and within the organisation's quotas. `before` is what `dep` took."""
        if dep.status == ACTIVE:
            check_deployable(org, org.name)
        session = self.repository.session
        others = await session.scalars(
            select(Deployment).where(Deployment.org_id == org.id, Deployment.id != dep.id)
        )
        used = [_footprint(d) for d in others]
        replicas, gpus = sum(r for r, _ in used), sum(g for _, g in used)
        after = _footprint(dep)
        plan = await session.get(Plan, org.plan_id) if org.plan_id is not None else None
        check_dedicated_quota(
            org.name,
            plan,
            self.config.quotas,
            replicas=(replicas + before[0], replicas + after[0]),
            gpus=(gpus + before[1], gpus + after[1]),
        )

    async def update_deployment(
        self, dep: Deployment, data: DeploymentUpdate, actor: Principal
    ) -> Deployment:
        self._may_change(dep, actor)
        session = self.repository.session
        changes = changes_of(data)
        _check_replicas(
            changes.get("min_replicas", dep.min_replicas), changes.get("max_replicas", dep.max_replicas)
        )
        before = snapshot(dep)
        took = _footprint(dep)
        if "adapters" in changes:
            if dep.org_id is None and changes["adapters"]:
                raise APIError(
                    400, "Adapters can only be pinned to a dedicated deployment.", param="adapters"
                )
            pinned = await _check_adapters(session, changes.pop("adapters"), dep.org_id, dep.model_id)
            _with_config(dep, "adapters", pinned)
        if "autoscaling" in changes:
            _check_autoscaling(changes["autoscaling"])
            _with_config(dep, "autoscaling", msgspec.to_builtins(changes.pop("autoscaling")))
        if dep.org_id is not None and "gpu_type" in changes:
            await self._check_gpu_type(changes["gpu_type"])
        if {"engine", "engine_args", "gpus_per_replica", "gpu_type"} & changes.keys():
            await self._change_engine(dep, changes)
        for name, value in changes.items():
            setattr(dep, name, value)
        if dep.org_id is not None:
            org = await session.get(Organization, dep.org_id)
            assert org is not None  # the foreign key cascades deletions
            await self._check_dedicated(org, dep, before=took)
        await session.flush()
        await record_change(
            session, actor, "update", "deployment", dep.id, org_id=dep.org_id, before=before, after=dep
        )
        return dep

    async def _change_engine(self, dep: Deployment, changes: dict[str, Any]) -> None:
        """Engine, engine_args and GPUs per replica as `changes` leave them (taking them out of
        `changes`), checked together: a new gpu_type or parallelism moves the GPU count."""
        engine = changes.pop("engine", dep.engine)
        if "engine_args" in changes:
            args = changes.pop("engine_args")
        else:
            # Kept (and checked again) on vLLM; back to builtin they mean nothing, so they go.
            args = dep.engine_args if engine == VLLM else {}
        model = await self.repository.session.get(Model, dep.model_id)
        assert model is not None  # the foreign key cascades deletions
        choice = choose_engine(
            engine,
            args,
            changes.pop("gpus_per_replica", None),
            gpu_type=changes.get("gpu_type", dep.gpu_type),
            kind=model.kind,
            context_length=model.context_length,
            current_gpus=dep.gpus_per_replica,
        )
        dep.engine, dep.engine_args, dep.gpus_per_replica = (
            choice.engine,
            choice.engine_args,
            choice.gpus_per_replica,
        )

    async def delete_deployment(self, dep: Deployment, actor: Principal) -> None:
        """Only a deployment that never ran: dedicated deployments are billed from their
        workers' lifetimes, which must keep pointing at them. Stop it instead."""
        self._may_change(dep, actor)
        session = self.repository.session
        if await session.scalar(select(Worker.id).where(Worker.deployment_id == dep.id).limit(1)) is not None:
            raise APIError(
                409,
                f"Deployment '{dep.name}' has run workers, whose lifetimes are billed; set its status "
                "to 'stopped' instead.",
                code="conflict",
            )
        await delete_recorded(session, actor, dep, "deployment", org_id=dep.org_id)
