"""Admin API under /admin/v1 (HTTP only; the logic is in services.py).

Roles: a platform admin manages everything; an organisation admin manages its own
organisation's users, keys, adapters and dedicated deployments and reads the shared
catalogue (models, serverless deployments, plans); member keys are for inference only.
Another organisation's resources answer 404, exactly like missing ones, so ids cannot be
probed.

Changes that gateways cache (keys, an organisation's status or plan, a plan's limits) are
committed first and then announced on the KEYS stream, so a gateway that drops its cached
record re-reads the new one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Router, delete, get, patch, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State, UploadFile
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from multipart import MultipartSegment
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane import lora
from control_plane.models import Deployment, Model, Plan
from control_plane.schemas import (
    AdapterOut,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyOut,
    ApiKeyUpdate,
    AuditEntryOut,
    AuditPage,
    Autoscaling,
    DeploymentCreate,
    DeploymentOut,
    DeploymentUpdate,
    ModelCreate,
    ModelOut,
    ModelUpdate,
    OrganizationCreate,
    OrganizationOut,
    OrganizationUpdate,
    PlanCreate,
    PlanOut,
    PlanUpdate,
    UserCreate,
    UserOut,
    UserUpdate,
)
from control_plane.services import (
    AdapterService,
    ApiKeyService,
    AuditQuery,
    AuditService,
    CreatedKey,
    DeploymentService,
    ModelService,
    OrganizationService,
    PlanService,
    Principal,
    UserService,
    authenticate,
    deployment_adapters,
    remove_adapter_files,
)
from tokenmill.bodies import MULTIPART_HEADER_BYTES, Form, read_multipart
from tokenmill.bus import EventBus
from tokenmill.clients import auth_failures
from tokenmill.errors import APIError
from tokenmill.protocol import KEYS, KeysChanged
from tokenmill.settings import Settings
from tokenmill.storage import Storage

ADMIN_ROLES = ("platform_admin", "org_admin")

# --- who is calling ------------------------------------------------------------------------


async def authenticate_admin(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    """The one place an admin caller is identified: today an admin API key in
    `Authorization: Bearer`; the dashboard's session login (issue 8) joins here."""
    scheme, _, secret = (connection.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise APIError(
            401, "Admin endpoints need 'Authorization: Bearer <admin key>'.", code="invalid_api_key"
        )
    state = connection.app.state
    # An address that keeps failing gets 429 before any further database read.
    with auth_failures(connection):
        async with state.sessionmaker() as session:
            key, _org = await authenticate(session, secret.strip(), state.settings.secret_key)
    if key.role not in ADMIN_ROLES:
        raise APIError(403, "This key may not use the admin API.", code="insufficient_permissions")
    return Principal(role=key.role, org_id=key.org_id, key_id=key.id, user_id=key.user_id)


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of every admin route (billing's included): who it is, kept for `provide_admin`."""
    connection.state.admin = await authenticate_admin(connection)


def provide_admin(request: Request[Any, Any, Any]) -> Principal:
    return request.state.admin


def _platform_only(admin: Principal, what: str) -> None:
    if not admin.is_platform_admin:
        raise APIError(403, f"Only platform admins {what}.", code="insufficient_permissions")


# --- dependencies ------------------------------------------------------------------------


def provide_settings(state: State) -> Settings:
    return state.settings


def provide_bus(state: State) -> EventBus:
    return state.bus


async def provide_orgs(db_session: NamedDependency[AsyncSession]) -> OrganizationService:
    return OrganizationService(session=db_session)


async def provide_users(db_session: NamedDependency[AsyncSession]) -> UserService:
    return UserService(session=db_session)


async def provide_keys(db_session: NamedDependency[AsyncSession]) -> ApiKeyService:
    return ApiKeyService(session=db_session)


async def provide_models(db_session: NamedDependency[AsyncSession]) -> ModelService:
    return ModelService(session=db_session)


async def provide_deployments(db_session: NamedDependency[AsyncSession]) -> DeploymentService:
    return DeploymentService(session=db_session)


async def provide_adapters(db_session: NamedDependency[AsyncSession]) -> AdapterService:
    return AdapterService(session=db_session)


async def provide_plans(db_session: NamedDependency[AsyncSession]) -> PlanService:
    return PlanService(session=db_session)


async def provide_audit(db_session: NamedDependency[AsyncSession]) -> AuditService:
    return AuditService(db_session)


async def announce(
    session: AsyncSession, bus: NamedDependency[EventBus], events: Sequence[KeysChanged]
) -> None:
    """Commit, then tell the gateways: the record they re-read must be the changed one."""
    await session.commit()
    for event in events:
        await bus.publish(KEYS, event)


# --- wire conversions --------------------------------------------------------------------


def _out(row: Any, kind: type[Any]) -> Any:
    return msgspec.convert(row, kind, from_attributes=True)


def _deployment_out(dep: Deployment) -> DeploymentOut:
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
    )


def _created(created: CreatedKey) -> ApiKeyCreated:
    return msgspec.structs.replace(_out(created.key, ApiKeyCreated), secret=created.secret)


# --- organisations -----------------------------------------------------------------------


class OrganizationController(Controller):
    path = "/organizations"
    tags = ["Admin: organisations"]

    @get()
    async def list_organizations(
        self, admin: NamedDependency[Principal], orgs: NamedDependency[OrganizationService]
    ) -> list[OrganizationOut]:
        return [_out(o, OrganizationOut) for o in await orgs.list_visible(admin)]

    @post()
    async def create_organization(
        self,
        data: JSONBody[OrganizationCreate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        _platform_only(admin, "create organisations")
        return _out(await orgs.create_org(data.name, plan_id=data.plan_id, actor=admin), OrganizationOut)

    @get("/{org_id:str}")
    async def get_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        return _out(await orgs.visible(org_id, admin), OrganizationOut)

    @patch("/{org_id:str}")
    async def update_organization(
        self,
        org_id: FromPath[str],
        data: JSONBody[OrganizationUpdate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> OrganizationOut:
        """Rename (its own admins may), assign a plan (`plan_id`, null for the default tier)
        or set how Stripe bills it (`billing_mode`); the last two for platform admins only."""
        org = await orgs.visible(org_id, admin)
        for param in ("plan_id", "billing_mode"):
            if getattr(data, param) is not msgspec.UNSET and not admin.is_platform_admin:
                raise APIError(
                    403, f"Only platform admins set {param}.", code="insufficient_permissions", param=param
                )
        if await orgs.update_org(org, data, admin):
            await announce(db_session, bus, [KeysChanged(org_id=org.id)])
        return _out(org, OrganizationOut)

    @post("/{org_id:str}/suspend", status_code=200)
    async def suspend_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> OrganizationOut:
        """Every key of the organisation is refused (403 organization_suspended) until resumed."""
        _platform_only(admin, "suspend organisations")
        org = await orgs.visible(org_id, admin)
        await orgs.set_status(org, "suspended", admin)
        await announce(db_session, bus, [KeysChanged(org_id=org.id)])
        return _out(org, OrganizationOut)

    @post("/{org_id:str}/resume", status_code=200)
    async def resume_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> OrganizationOut:
        _platform_only(admin, "resume organisations")
        org = await orgs.visible(org_id, admin)
        await orgs.set_status(org, "active", admin)
        await announce(db_session, bus, [KeysChanged(org_id=org.id)])
        return _out(org, OrganizationOut)


# --- users -------------------------------------------------------------------------------


class UserController(Controller):
    path = "/"
    tags = ["Admin: users"]

    @get("/organizations/{org_id:str}/users")
    async def list_users(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        users: NamedDependency[UserService],
    ) -> list[UserOut]:
        org = await orgs.visible(org_id, admin)
        return [_out(u, UserOut) for u in await users.list_for_org(org.id)]

    @post("/organizations/{org_id:str}/users")
    async def create_user(
        self,
        org_id: FromPath[str],
        data: JSONBody[UserCreate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        users: NamedDependency[UserService],
    ) -> UserOut:
        org = await orgs.visible(org_id, admin)
        user = await users.create_user(
            org_id=org.id, email=data.email, password=data.password, role=data.role, actor=admin
        )
        return _out(user, UserOut)

    @get("/users/{user_id:str}")
    async def get_user(
        self, user_id: FromPath[str], admin: NamedDependency[Principal], users: NamedDependency[UserService]
    ) -> UserOut:
        return _out(await users.visible(user_id, admin), UserOut)

    @patch("/users/{user_id:str}")
    async def update_user(
        self,
        user_id: FromPath[str],
        data: JSONBody[UserUpdate],
        admin: NamedDependency[Principal],
        users: NamedDependency[UserService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> UserOut:
        """Change role or password, or disable (which revokes the user's API keys) / enable."""
        user = await users.visible(user_id, admin)
        revoked = await users.update_user(user, data, admin)
        if revoked:
            await announce(db_session, bus, [KeysChanged(prefix=p) for p in revoked])
        return _out(user, UserOut)


# --- API keys ----------------------------------------------------------------------------


class ApiKeyController(Controller):
    path = "/"
    tags = ["Admin: API keys"]

    @get("/organizations/{org_id:str}/keys")
    async def list_keys(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        keys: NamedDependency[ApiKeyService],
    ) -> list[ApiKeyOut]:
        org = await orgs.visible(org_id, admin)
        return [_out(k, ApiKeyOut) for k in await keys.list_for_org(org.id)]

    @post("/organizations/{org_id:str}/keys")
    async def create_key(
        self,
        org_id: FromPath[str],
        data: JSONBody[ApiKeyCreate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        keys: NamedDependency[ApiKeyService],
        settings: NamedDependency[Settings],
    ) -> ApiKeyCreated:
        """The secret is in this answer only; it is stored as a keyed hash."""
        org = await orgs.visible(org_id, admin)
        created = await keys.create_key(
            org_id=org.id,
            secret_key=settings.secret_key or "",
            name=data.name,
            role=data.role,
            scopes=data.scopes,
            expires_at=data.expires_at,
            user_id=data.user_id,
            limits={
                "requests_per_minute": data.requests_per_minute,
                "tokens_per_minute": data.tokens_per_minute,
                "request_burst": data.request_burst,
                "token_burst": data.token_burst,
                "max_concurrent": data.max_concurrent,
            },
            actor=admin,
        )
        return _created(created)

    @get("/keys/{key_id:str}")
    async def get_key(
        self, key_id: FromPath[str], admin: NamedDependency[Principal], keys: NamedDependency[ApiKeyService]
    ) -> ApiKeyOut:
        return _out(await keys.visible(key_id, admin), ApiKeyOut)

    @patch("/keys/{key_id:str}")
    async def update_key(
        self,
        key_id: FromPath[str],
        data: JSONBody[ApiKeyUpdate],
        admin: NamedDependency[Principal],
        keys: NamedDependency[ApiKeyService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> ApiKeyOut:
        """Name, scopes, expiry and per-key limits; null clears a limit or the expiry."""
        key = await keys.visible(key_id, admin)
        key = await keys.update_key(key, data, admin)
        await announce(db_session, bus, [KeysChanged(prefix=key.prefix)])
        return _out(key, ApiKeyOut)

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(
        self,
        key_id: FromPath[str],
        admin: NamedDependency[Principal],
        keys: NamedDependency[ApiKeyService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> ApiKeyOut:
        key = await keys.revoke(key_id, org_id=None if admin.is_platform_admin else admin.org_id, actor=admin)
        await announce(db_session, bus, [KeysChanged(prefix=key.prefix)])
        return _out(key, ApiKeyOut)

    @post("/keys/{key_id:str}/rotate")
    async def rotate_key(
        self,
        key_id: FromPath[str],
        admin: NamedDependency[Principal],
        keys: NamedDependency[ApiKeyService],
        settings: NamedDependency[Settings],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> ApiKeyCreated:
        """A new secret with the same name, scopes, expiry and limits; the old key is revoked
        at once, everywhere."""
        key = await keys.visible(key_id, admin)
        created = await keys.rotate(key, secret_key=settings.secret_key or "", actor=admin)
        await announce(db_session, bus, [KeysChanged(prefix=key.prefix)])
        return _created(created)


# --- models ------------------------------------------------------------------------------


class ModelController(Controller):
    path = "/models"
    tags = ["Admin: models"]

    @get()
    async def list_models(self, models: NamedDependency[ModelService]) -> list[ModelOut]:
        return [_out(m, ModelOut) for m in await models.get_many(order_by=[(Model.name, False)])]

    @post()
    async def create_model(
        self,
        data: JSONBody[ModelCreate],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> ModelOut:
        _platform_only(admin, "add models")
        return _out(await models.create_model(data, admin), ModelOut)

    @get("/{model_id:str}")
    async def get_model(self, model_id: FromPath[str], models: NamedDependency[ModelService]) -> ModelOut:
        return _out(await models.get_ref(model_id), ModelOut)

    @patch("/{model_id:str}")
    async def update_model(
        self,
        model_id: FromPath[str],
        data: JSONBody[ModelUpdate],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> ModelOut:
        _platform_only(admin, "change models")
        return _out(await models.update_model(await models.get_ref(model_id), data, admin), ModelOut)

    @delete("/{model_id:str}")
    async def delete_model(
        self,
        model_id: FromPath[str],
        admin: NamedDependency[Principal],
        models: NamedDependency[ModelService],
    ) -> None:
        _platform_only(admin, "delete models")
        await models.delete_model(await models.get_ref(model_id), admin)


# --- deployments -------------------------------------------------------------------------


class DeploymentController(Controller):
    path = "/deployments"
    tags = ["Admin: deployments"]

    @get()
    async def list_deployments(
        self,
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
        org_id: Annotated[
            str | None, QueryParameter(description="Only this organisation's dedicated ones.")
        ] = None,
    ) -> list[DeploymentOut]:
        """The serverless deployments and the dedicated ones the caller may see."""
        if org_id is not None and not admin.sees(org_id):
            raise APIError(404, f"No organisation '{org_id}'.", code="not_found", param="org_id")
        return [_deployment_out(d) for d in await deployments.list_visible(admin, org_id)]

    @post()
    async def create_deployment(
        self,
        data: JSONBody[DeploymentCreate],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        return _deployment_out(await deployments.create_deployment(data, admin))

    @get("/{deployment_id:str}")
    async def get_deployment(
        self,
        deployment_id: FromPath[str],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        return _deployment_out(await deployments.visible(deployment_id, admin))

    @patch("/{deployment_id:str}")
    async def update_deployment(
        self,
        deployment_id: FromPath[str],
        data: JSONBody[DeploymentUpdate],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> DeploymentOut:
        dep = await deployments.visible(deployment_id, admin)
        return _deployment_out(await deployments.update_deployment(dep, data, admin))

    @delete("/{deployment_id:str}")
    async def delete_deployment(
        self,
        deployment_id: FromPath[str],
        admin: NamedDependency[Principal],
        deployments: NamedDependency[DeploymentService],
    ) -> None:
        dep = await deployments.visible(deployment_id, admin)
        await deployments.delete_deployment(dep, admin)


# --- adapters ----------------------------------------------------------------------------

_UPLOAD_HELP = (
    "Upload a PEFT LoRA adapter as multipart/form-data: text fields 'name' and 'model' (the base "
    f"model's id or name), then the files {lora.CONFIG_FILE} and {lora.WEIGHTS_FILE}."
)
# A text field of an upload (a name, a model id, a CSRF token) and parts in all: what a
# valid upload needs, with room to spare, and not a byte of memory more.
UPLOAD_FIELD_BYTES = 4096
UPLOAD_PARTS = 16


@dataclass(slots=True)
class AdapterUpload:
    """An adapter upload as received: its form (close it when done) and its parts."""

    form: Form
    name: str
    model: str
    config: bytes
    weights: UploadFile
    weights_size: int


def _file_role(field: str, filename: str | None) -> str:
    """Which file of an adapter a part is: by file name or by field name, so
    `-F file=@adapter_config.json`, `-F adapter_config.json=@x.json` and the dashboard's
    `config`/`weights` inputs all work."""
    base = os.path.basename(filename or "")
    if "adapter_model.bin" in (base, field) or (field == "weights" and base.endswith(".bin")):
        raise APIError(
            400,
            "Pickled adapter_model.bin files are not accepted (loading them runs code); "
            f"save the adapter with safetensors ({lora.WEIGHTS_FILE}).",
            param=lora.WEIGHTS_FILE,
        )
    if lora.CONFIG_FILE in (base, field) or field == "config":
        return lora.CONFIG_FILE
    if lora.WEIGHTS_FILE in (base, field) or field == "weights":
        return lora.WEIGHTS_FILE
    raise APIError(400, f"Unexpected file '{base or field}'. {_UPLOAD_HELP}", param=field)


async def read_adapter_upload(
    request: Request[Any, Any, Any],
    adapters: AdapterService,
    settings: Settings,
    storage: Storage,
    *,
    before_files: Callable[[Form], Awaitable[None]] | None = None,
) -> AdapterUpload:
    """Stream an adapter upload in, refusing it (413) as soon as a part passes its limit:
    text fields `UPLOAD_FIELD_BYTES`, the config 1 MiB, the weights the largest valid
    adapter for the base model at `TOKENMILL_MAX_LORA_RANK` (so `model` must come before
    the weights). `before_files` runs once, on the text fields, before any file is read
    (the dashboard checks its CSRF token and organisation there)."""
    content_type, options = request.content_type
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise APIError(415, _UPLOAD_HELP)
    checked = False
    weights: tuple[int, str] | None = None

    async def check(form: Form) -> None:
        nonlocal checked
        if not checked and before_files is not None:
            await before_files(form)
        checked = True

    async def file_limit(part: MultipartSegment, form: Form) -> tuple[int, str]:
        nonlocal weights
        await check(form)
        role = _file_role(part.name or "", part.filename)
        if any(_file_role(f, u.filename) == role for f, u in form.files):
            raise APIError(400, f"{role} was sent twice.", param=role)
        model = (form.text("model") or "").strip()
        if role == lora.WEIGHTS_FILE and not model:
            raise APIError(
                400,
                f"Send the 'model' field before {lora.WEIGHTS_FILE} (its size limit depends on the "
                f"base model). {_UPLOAD_HELP}",
                param="model",
            )
        if weights is None and model:
            name, size = await adapters.weights_limit(
                model, cache_dir=settings.cache_dir, storage=storage, max_rank=settings.max_lora_rank
            )
            why = f", the largest valid adapter for {name} at rank {settings.max_lora_rank}"
            weights = size, why
            # Everything a valid upload can hold: refuse a larger announced body before reading it.
            whole = size + lora.MAX_CONFIG + UPLOAD_PARTS * (UPLOAD_FIELD_BYTES + MULTIPART_HEADER_BYTES * 8)
            if (request.content_length or 0) > whole:
                raise APIError(
                    413, f"The upload is larger than {whole} bytes{why}.", code="request_too_large"
                )
        if role == lora.CONFIG_FILE:
            return lora.MAX_CONFIG, ""
        assert weights is not None
        return weights

    form = await read_multipart(
        request.stream(),
        boundary.encode(),
        text_limit=UPLOAD_FIELD_BYTES,
        max_parts=UPLOAD_PARTS,
        file_limit=file_limit,
    )
    try:
        await check(form)  # an upload without files still has its fields checked
        # The first of each, as the weights' limit was decided from the first `model`.
        fields = {param: form.text(param) or "" for param in ("name", "model")}
        for param, value in fields.items():
            if not value.strip():
                raise APIError(400, f"'{param}' is missing. {_UPLOAD_HELP}", param=param)
        files = {_file_role(f, u.filename): u for f, u in form.files}
        for name in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
            if name not in files:
                raise APIError(400, f"{name} is missing. {_UPLOAD_HELP}", param=name)
        config = await files[lora.CONFIG_FILE].read()
        weights_file = files[lora.WEIGHTS_FILE]
        size = await asyncio.to_thread(_file_size, weights_file)
    except BaseException:
        await form.close()
        raise
    return AdapterUpload(form, fields["name"], fields["model"].strip(), config, weights_file, size)


def _file_size(upload: UploadFile) -> int:
    upload.file.seek(0, os.SEEK_END)
    size = upload.file.tell()
    upload.file.seek(0)
    return size


class AdapterController(Controller):
    path = "/"
    tags = ["Admin: adapters"]

    @get("/organizations/{org_id:str}/adapters")
    async def list_adapters(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        adapters: NamedDependency[AdapterService],
    ) -> list[AdapterOut]:
        org = await orgs.visible(org_id, admin)
        return [_out(a, AdapterOut) for a in await adapters.list_for_org(org.id)]

    # No body limit of Litestar's: `read_adapter_upload` sets one from the base model.
    @post("/organizations/{org_id:str}/adapters", request_max_body_size=None)
    async def upload_adapter(
        self,
        org_id: FromPath[str],
        request: Request[Any, Any, Any],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        adapters: NamedDependency[AdapterService],
        storage: NamedDependency[Storage],
        settings: NamedDependency[Settings],
        db_session: NamedDependency[AsyncSession],
    ) -> AdapterOut:
        """Checked against the base model's layer shapes and the rank limit, then stored."""
        org = await orgs.visible(org_id, admin)
        upload = await read_adapter_upload(request, adapters, settings, storage)
        try:
            adapter = await adapters.create_adapter(
                org_id=org.id,
                name=upload.name,
                model_ref=upload.model,
                config_raw=upload.config,
                weights=upload.weights.file,
                weights_size=upload.weights_size,
                storage=storage,
                cache_dir=settings.cache_dir,
                max_rank=settings.max_lora_rank,
                actor=admin,
            )
            out = _out(adapter, AdapterOut)
            # Commit here, not after the handler: if it fails, the stored files go too.
            try:
                await db_session.commit()
            except BaseException:
                await asyncio.to_thread(remove_adapter_files, storage, adapter.storage_key or "")
                raise
            return out
        finally:
            await upload.form.close()

    @get("/adapters/{adapter_id:str}")
    async def get_adapter(
        self,
        adapter_id: FromPath[str],
        admin: NamedDependency[Principal],
        adapters: NamedDependency[AdapterService],
    ) -> AdapterOut:
        return _out(await adapters.visible(adapter_id, admin), AdapterOut)

    @delete("/adapters/{adapter_id:str}")
    async def delete_adapter(
        self,
        adapter_id: FromPath[str],
        admin: NamedDependency[Principal],
        adapters: NamedDependency[AdapterService],
        storage: NamedDependency[Storage],
        db_session: NamedDependency[AsyncSession],
    ) -> None:
        """Removes the row and then the stored files."""
        adapter = await adapters.visible(adapter_id, admin)
        prefix = await adapters.delete_adapter(adapter, admin)
        await db_session.commit()
        if prefix:
            await asyncio.to_thread(remove_adapter_files, storage, prefix)


# --- plans -------------------------------------------------------------------------------


class PlanController(Controller):
    path = "/plans"
    tags = ["Admin: plans"]

    @get()
    async def list_plans(self, plans: NamedDependency[PlanService]) -> list[PlanOut]:
        return [_out(p, PlanOut) for p in await plans.get_many(order_by=[(Plan.name, False)])]

    @post()
    async def create_plan(
        self,
        data: JSONBody[PlanCreate],
        admin: NamedDependency[Principal],
        plans: NamedDependency[PlanService],
    ) -> PlanOut:
        _platform_only(admin, "create plans")
        return _out(await plans.create_plan(data, admin), PlanOut)

    @get("/{plan_id:str}")
    async def get_plan(self, plan_id: FromPath[str], plans: NamedDependency[PlanService]) -> PlanOut:
        return _out(await plans.get_ref(plan_id), PlanOut)

    @patch("/{plan_id:str}")
    async def update_plan(
        self,
        plan_id: FromPath[str],
        data: JSONBody[PlanUpdate],
        admin: NamedDependency[Principal],
        plans: NamedDependency[PlanService],
        db_session: NamedDependency[AsyncSession],
        bus: NamedDependency[EventBus],
    ) -> PlanOut:
        """New limits apply to every organisation on the plan at once."""
        _platform_only(admin, "change plans")
        plan = await plans.get_ref(plan_id)
        org_ids = await plans.update_plan(plan, data, admin)
        await announce(db_session, bus, [KeysChanged(org_id=o) for o in org_ids])
        return _out(plan, PlanOut)

    @delete("/{plan_id:str}")
    async def delete_plan(
        self, plan_id: FromPath[str], admin: NamedDependency[Principal], plans: NamedDependency[PlanService]
    ) -> None:
        _platform_only(admin, "delete plans")
        await plans.delete_plan(await plans.get_ref(plan_id), admin)


# --- audit log ---------------------------------------------------------------------------


class AuditController(Controller):
    path = "/audit"
    tags = ["Admin: audit log"]

    @get()
    async def list_audit(
        self,
        admin: NamedDependency[Principal],
        audit: NamedDependency[AuditService],
        org_id: FromQuery[str | None] = None,
        resource_type: FromQuery[str | None] = None,
        resource_id: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        actor_key_id: FromQuery[str | None] = None,
        since: Annotated[
            datetime | None, QueryParameter(description="Entries at or after (ISO 8601).")
        ] = None,
        until: Annotated[datetime | None, QueryParameter(description="Entries before (ISO 8601).")] = None,
        after: Annotated[int | None, QueryParameter(description="`last_id` of the previous page.")] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> AuditPage:
        """Every admin change, newest first: who, what, when, before and after. Platform
        admins read all of it; organisation admins their organisation's."""
        query = AuditQuery(
            org_id=org_id,
            resource_type=resource_type,
            resource_id=resource_id,
            action=action,
            actor_key_id=actor_key_id,
            since=since,
            until=until,
            after=after,
            limit=limit,
        )
        rows, more = await audit.page(query, admin)
        data = [_out(r, AuditEntryOut) for r in rows]
        return AuditPage(
            data=data,
            has_more=more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )


# --- the router --------------------------------------------------------------------------

ADMIN_DEPENDENCIES = {
    "admin": Provide(provide_admin, sync_to_thread=False),
    "settings": Provide(provide_settings, sync_to_thread=False),
    "bus": Provide(provide_bus, sync_to_thread=False),
    "orgs": Provide(provide_orgs),
    "users": Provide(provide_users),
    "keys": Provide(provide_keys),
    "models": Provide(provide_models),
    "deployments": Provide(provide_deployments),
    "adapters": Provide(provide_adapters),
    "plans": Provide(provide_plans),
    "audit": Provide(provide_audit),
}


def admin_router() -> Router:
    """Everything under /admin/v1 of the control plane, behind the admin guard (a new
    Router per app, so several apps in one process never share one)."""
    return Router(
        path="/admin/v1",
        route_handlers=[
            OrganizationController,
            UserController,
            ApiKeyController,
            ModelController,
            DeploymentController,
            AdapterController,
            PlanController,
            AuditController,
        ],
        guards=[require_admin],
        dependencies=ADMIN_DEPENDENCIES,
    )
