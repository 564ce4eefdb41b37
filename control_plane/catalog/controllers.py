"""Admin API of the catalogue: models, deployments, adapters (HTTP only: the rules are the
services')."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody, QueryParameter

from control_plane.catalog.adapters import AdapterService
from control_plane.catalog.deployments import DeploymentService
from control_plane.catalog.models import Deployment
from control_plane.catalog.schemas import (
    AdapterOut,
    Autoscaling,
    DeploymentCreate,
    DeploymentOut,
    DeploymentUpdate,
    ModelCreate,
    ModelOut,
    ModelUpdate,
)
from control_plane.catalog.services import ModelService, deployment_adapters
from control_plane.catalog.uploads import read_adapter_upload
from control_plane.orgs.services import OrganizationService
from control_plane.paging import LIST_PAGE, PageQuery, link_header
from control_plane.policy import Principal
from control_plane.wire import out


def deployment_out(dep: Deployment) -> DeploymentOut:
    return DeploymentOut(
        id=dep.id,
        name=dep.name,
        model_id=dep.model_id,
        org_id=dep.org_id,
        type=dep.type,
        kind=dep.kind,
        gpu_type=dep.gpu_type,
        min_replicas=dep.min_replicas,
        max_replicas=dep.max_replicas,
        status=dep.status,
        adapters=deployment_adapters(dep),
        created_at=dep.created_at,
        autoscaling=msgspec.convert((dep.config or {}).get("autoscaling", {}), Autoscaling),
        engine=dep.engine,
        engine_args=dict(dep.engine_args or {}),
        gpus_per_replica=dep.gpus_per_replica,
    )


class ModelController(Controller):
    path = "/models"
    tags = ["Admin: models"]

    @get()
    async def list_models(self, models: NamedDependency[ModelService]) -> list[ModelOut]:
        return [out(m, ModelOut) for m in await models.list_models()]

    @post()
    async def create_model(
        self,
        data: JSONBody[ModelCreate],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> ModelOut:
        return out(await models.create_model(data, admin), ModelOut)

    @get("/{model_id:str}")
    async def get_model(self, model_id: FromPath[str], models: NamedDependency[ModelService]) -> ModelOut:
        return out(await models.get_ref(model_id), ModelOut)

    @patch("/{model_id:str}")
    async def update_model(
        self,
        model_id: FromPath[str],
        data: JSONBody[ModelUpdate],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> ModelOut:
        return out(await models.update_model(await models.get_ref(model_id), data, admin), ModelOut)

    @delete("/{model_id:str}")
    async def delete_model(
        self,
        model_id: FromPath[str],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> None:
        await models.delete_model(await models.get_ref(model_id), admin)


class DeploymentController(Controller):
    path = "/deployments"
    tags = ["Admin: deployments"]

    @get(dependencies=LIST_PAGE)
    async def list_deployments(
        self,
        request: Request[Any, Any, Any],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
        page: NamedDependency[PageQuery],
        org_id: Annotated[
            str | None, QueryParameter(description="Only this organisation's dedicated ones.")
        ] = None,
    ) -> Response[list[DeploymentOut]]:
        """The serverless deployments and the dedicated ones the caller may see, by name; `q`
        searches names and base model names. With `limit`, one page (`Link` names the next)."""
        found = await deployments.page_visible(admin, page, org_id)
        return Response([deployment_out(d) for d in found.rows], headers=link_header(str(request.url), found))

    @post()
    async def create_deployment(
        self,
        data: JSONBody[DeploymentCreate],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        """A dedicated one needs a `gpu_type` from the price book and must fit its
        organisation's quotas (`max_dedicated_replicas`, `max_gpus` of its plan, counting
        `gpus_per_replica` per replica). `engine: vllm` runs it on vLLM with `engine_args`
        from an allowlist; `gpus_per_replica` defaults to tensor x pipeline parallel size."""
        return deployment_out(await deployments.create_deployment(data, admin))

    @get("/{deployment_id:str}")
    async def get_deployment(
        self,
        deployment_id: FromPath[str],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        return deployment_out(await deployments.visible(deployment_id, admin))

    @patch("/{deployment_id:str}")
    async def update_deployment(
        self,
        deployment_id: FromPath[str],
        data: JSONBody[DeploymentUpdate],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        dep = await deployments.visible(deployment_id, admin)
        return deployment_out(await deployments.update_deployment(dep, data, admin))

    @delete("/{deployment_id:str}")
    async def delete_deployment(
        self,
        deployment_id: FromPath[str],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> None:
        dep = await deployments.visible(deployment_id, admin)
        await deployments.delete_deployment(dep, admin)


class AdapterController(Controller):
    path = "/"
    tags = ["Admin: adapters"]

    @get("/organizations/{org_id:str}/adapters", dependencies=LIST_PAGE)
    async def list_adapters(
        self,
        request: Request[Any, Any, Any],
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        adapters: NamedDependency[AdapterService],
        page: NamedDependency[PageQuery],
    ) -> Response[list[AdapterOut]]:
        """By name; `q` searches names. With `limit`, one page (`Link` names the next)."""
        org = await orgs.visible(org_id, admin)
        found = await adapters.page_for_org(org.id, page)
        return Response(
            [out(a, AdapterOut) for a in found.rows], headers=link_header(str(request.url), found)
        )

    # No body limit of Litestar's: `read_adapter_upload` sets one from the base model.
    @post("/organizations/{org_id:str}/adapters", request_max_body_size=None)
    async def upload_adapter(
        self,
        org_id: FromPath[str],
        request: Request[Any, Any, Any],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        adapters: NamedDependency[AdapterService],
    ) -> AdapterOut:
        """Checked against the base model's layer shapes and the rank limit, then stored."""
        org = await orgs.visible(org_id, admin)
        upload = await read_adapter_upload(request, adapters)
        try:
            return out(await adapters.upload(org.id, upload.files, admin), AdapterOut)
        finally:
            await upload.form.close()

    @get("/adapters/{adapter_id:str}")
    async def get_adapter(
        self,
        adapter_id: FromPath[str],
        admin: NamedDependency[Principal],
        adapters: NamedDependency[AdapterService],
    ) -> AdapterOut:
        return out(await adapters.visible(adapter_id, admin), AdapterOut)

    @delete("/adapters/{adapter_id:str}")
    async def delete_adapter(
        self,
        adapter_id: FromPath[str],
        admin: NamedDependency[Principal],
        adapters: NamedDependency[AdapterService],
    ) -> None:
        """Removes the row and, once that is committed, the stored files."""
        await adapters.delete_adapter(await adapters.visible(adapter_id, admin), admin)
