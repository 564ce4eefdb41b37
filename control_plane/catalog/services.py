"""The catalogue as the gateway reads it (`CatalogService`) and base models as platform admins
write them (`ModelService`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.services import delete_recorded, record_change, snapshot
from control_plane.catalog.models import ACTIVE, Adapter, Deployment, Model
from control_plane.common import changes as changes_of
from control_plane.common import flush_unique, not_found
from control_plane.policy import SYSTEM, Principal, require_platform_admin
from tokenmill.errors import APIError

if TYPE_CHECKING:
    from control_plane.catalog.schemas import ModelCreate, ModelUpdate


def deployment_adapters(dep: Deployment) -> list[str]:
    return list((dep.config or {}).get("adapters") or [])


async def model_ref(session: AsyncSession, ref: str, param: str = "model") -> Model:
    """A base model named in a request body, by id or name (400 naming `param` if none)."""
    model = await session.scalar(select(Model).where(or_(Model.id == ref, Model.name == ref)))
    if model is None:
        raise APIError(400, f"No model '{ref}'.", param=param)
    return model


class CatalogService:
    """Models and the deployments that serve them, as callers see them (the gateway's read
    model), and what the first start puts in the catalogue."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def ensure_model(
        self, *, name: str, source: str, format: str, kind: str, context_length: int
    ) -> Model:
        model = await self.session.scalar(select(Model).where(Model.name == name))
        if model is None:
            model = Model(name=name, source=source, format=format, kind=kind, context_length=context_length)
            self.session.add(model)
            await self.session.flush()
            await record_change(self.session, SYSTEM, "create", "model", model.id, org_id=None, after=model)
        return model

    async def ensure_serverless(self, model: Model, sampling: dict[str, float] | None = None) -> Deployment:
        """The shared deployment of a model; `sampling` holds defaults for parameters a
        request leaves out (as vLLM applies a model's generation config)."""
        dep = await self.session.scalar(
            select(Deployment).where(Deployment.name == model.name, Deployment.org_id.is_(None))
        )
        if dep is None:
            dep = Deployment(
                name=model.name,
                model_id=model.id,
                kind=model.kind,
                type="serverless",
                config={"sampling": sampling or {}},
            )
            self.session.add(dep)
            await self.session.flush()
            await record_change(self.session, SYSTEM, "create", "deployment", dep.id, org_id=None, after=dep)
        return dep

    async def visible_deployments(self, org_id: str) -> list[tuple[Deployment, Model]]:
        """Serverless deployments plus the organisation's own dedicated ones, if active."""
        result = await self.session.execute(
            select(Deployment, Model)
            .join(Model, Model.id == Deployment.model_id)
            .where(Deployment.status == ACTIVE)
            .where(or_(Deployment.org_id.is_(None), Deployment.org_id == org_id))
            .order_by(Deployment.name)
        )
        return [(d, m) for d, m in result.all()]

    async def adapters(self, org_id: str) -> list[Adapter]:
        """The organisation's own LoRA adapters (no one else's, ever)."""
        result = await self.session.scalars(
            select(Adapter).where(Adapter.org_id == org_id).order_by(Adapter.name)
        )
        return list(result)

    async def resolve(self, name: str, org_id: str) -> tuple[Deployment, Model, Adapter | None]:
        """A model name as a caller of `org_id` sees it: a deployment it may use, or one of
        its own adapters, served by the shared deployment of the adapter's base model."""
        visible = await self.visible_deployments(org_id)
        for dep, model in visible:
            if dep.name == name:
                return dep, model, None
        adapter = await self.session.scalar(
            select(Adapter).where(Adapter.org_id == org_id, Adapter.name == name)
        )
        if adapter is not None:
            for dep, model in visible:
                if model.id == adapter.model_id and dep.org_id is None:
                    return dep, model, adapter
        raise APIError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )


def _check_source(source: str, format: str) -> None:
    source = source.strip()
    if not source:
        raise APIError(400, "source must not be empty.", param="source")
    if format == "gguf" and not (source.endswith(".gguf") or source.startswith(("bundled:", "store:"))):
        raise APIError(
            400,
            "A gguf model's source must be a .gguf file, bundled:<name> or store:<prefix holding one>.",
            param="source",
        )


class ModelService(SQLAlchemyAsyncRepositoryService[Model]):
    """Base models: written by platform admins, read by every admin."""

    class Repo(SQLAlchemyAsyncRepository[Model]):
        model_type = Model

    repository_type = Repo

    async def list_models(self) -> list[Model]:
        return list(await self.get_many(order_by=[(Model.name, False)]))

    async def get_ref(self, ref: str) -> Model:
        model = await self.get_one_or_none(or_(Model.id == ref, Model.name == ref))
        if model is None:
            raise not_found("model", ref)
        return model

    async def create_model(self, data: ModelCreate, actor: Principal) -> Model:
        require_platform_admin(actor, "add models")
        session = self.repository.session
        if await self.exists(name=data.name):
            raise APIError(409, f"A model named '{data.name}' already exists.", param="name")
        _check_source(data.source, data.format)
        model = Model(
            name=data.name,
            source=data.source.strip(),
            format=data.format,
            kind=data.kind,
            context_length=data.context_length,
        )
        session.add(model)
        await flush_unique(session, f"A model named '{data.name}' already exists.", "name")
        await record_change(session, actor, "create", "model", model.id, org_id=None, after=model)
        return model

    async def update_model(self, model: Model, data: ModelUpdate, actor: Principal) -> Model:
        require_platform_admin(actor, "change models")
        changes = changes_of(data)
        _check_source(changes.get("source", model.source), changes.get("format", model.format))
        before = snapshot(model)
        for name, value in changes.items():
            setattr(model, name, value.strip() if name == "source" else value)
        await self.repository.session.flush()
        await record_change(
            self.repository.session,
            actor,
            "update",
            "model",
            model.id,
            org_id=None,
            before=before,
            after=model,
        )
        return model

    async def delete_model(self, model: Model, actor: Principal) -> None:
        """Only a model nothing uses: deleting one would cascade to tenants' deployments and
        adapters (and their stored files)."""
        require_platform_admin(actor, "delete models")
        session = self.repository.session
        deployments = await session.scalar(select(func.count()).where(Deployment.model_id == model.id))
        adapters = await session.scalar(select(func.count()).where(Adapter.model_id == model.id))
        if deployments or adapters:
            raise APIError(
                409,
                f"Model '{model.name}' is used by {deployments} deployment(s) and {adapters} adapter(s); "
                "delete those first.",
                code="conflict",
            )
        await delete_recorded(session, actor, model, "model", org_id=None)
