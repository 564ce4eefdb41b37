"""Admin API under /admin/v1 (HTTP only; the logic is in services.py)."""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.models import ApiKey, Organization
from control_plane.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyOut, OrganizationCreate, OrganizationOut
from control_plane.services import ApiKeyService, OrganizationService, authenticate
from tokenmill.errors import APIError
from tokenmill.protocol import KEYS, KeysChanged

ADMIN_ROLES = ("platform_admin", "org_admin")


async def require_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    scheme, _, secret = (connection.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not secret:
        raise APIError(
            401, "Admin endpoints need 'Authorization: Bearer <admin key>'.", code="invalid_api_key"
        )
    state = connection.app.state
    async with state.sessionmaker() as session:
        key, _org = await authenticate(session, secret.strip(), state.settings.secret_key)
    if key.role not in ADMIN_ROLES:
        raise APIError(403, "This key may not use the admin API.", code="insufficient_permissions")
    connection.state.admin = key


def provide_admin(request: Request) -> ApiKey:
    return request.state.admin


def _check_org(admin: NamedDependency[ApiKey], org_id: str) -> None:
    # Organisation admins see their own organisation only; answer 404 rather than 403 so
    # other tenants' ids cannot be probed.
    if admin.role != "platform_admin" and admin.org_id != org_id:
        raise APIError(404, f"No organisation '{org_id}'.", code="not_found")


def _org_out(o: Organization) -> OrganizationOut:
    return msgspec.convert(o, OrganizationOut, from_attributes=True)


def _key_out(k: ApiKey) -> ApiKeyOut:
    return msgspec.convert(k, ApiKeyOut, from_attributes=True)


async def provide_orgs(db_session: NamedDependency[AsyncSession]) -> OrganizationService:
    return OrganizationService(session=db_session)


async def provide_keys(db_session: NamedDependency[AsyncSession]) -> ApiKeyService:
    return ApiKeyService(session=db_session)


class AdminController(Controller):
    path = "/admin/v1"
    guards = [require_admin]
    tags = ["Admin"]
    dependencies = {
        "admin": Provide(provide_admin, sync_to_thread=False),
        "orgs": Provide(provide_orgs),
        "keys": Provide(provide_keys),
    }

    @get("/organizations")
    async def list_organizations(
        self, admin: NamedDependency[ApiKey], orgs: NamedDependency[OrganizationService]
    ) -> list[OrganizationOut]:
        if admin.role == "platform_admin":
            found = await orgs.get_many(order_by=[(Organization.created_at, False)])
        else:
            found = await orgs.get_many(Organization.id == admin.org_id)
        return [_org_out(o) for o in found]

    @post("/organizations")
    async def create_organization(
        self,
        data: JSONBody[OrganizationCreate],
        admin: NamedDependency[ApiKey],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        if admin.role != "platform_admin":
            raise APIError(403, "Only platform admins create organisations.", code="insufficient_permissions")
        return _org_out(await orgs.create_org(data.name))

    @get("/organizations/{org_id:str}/keys")
    async def list_keys(
        self, org_id: FromPath[str], admin: NamedDependency[ApiKey], keys: NamedDependency[ApiKeyService]
    ) -> list[ApiKeyOut]:
        _check_org(admin, org_id)
        return [_key_out(k) for k in await keys.list_for_org(org_id)]

    @post("/organizations/{org_id:str}/keys")
    async def create_key(
        self,
        org_id: FromPath[str],
        data: JSONBody[ApiKeyCreate],
        admin: NamedDependency[ApiKey],
        orgs: NamedDependency[OrganizationService],
        keys: NamedDependency[ApiKeyService],
        request: Request,
    ) -> ApiKeyCreated:
        _check_org(admin, org_id)
        org = await orgs.by_ref(org_id)
        if data.role == "platform_admin" and admin.role != "platform_admin":
            raise APIError(403, "Only platform admins create platform-admin keys.", param="role")
        created = await keys.create_key(
            org_id=org.id,
            secret_key=request.app.state.settings.secret_key,
            name=data.name,
            role=data.role,
            scopes=data.scopes,
            expires_at=data.expires_at,
        )
        return msgspec.structs.replace(
            msgspec.convert(created.key, ApiKeyCreated, from_attributes=True), secret=created.secret
        )

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(
        self,
        key_id: FromPath[str],
        admin: NamedDependency[ApiKey],
        keys: NamedDependency[ApiKeyService],
        request: Request,
    ) -> ApiKeyOut:
        org_id = None if admin.role == "platform_admin" else admin.org_id
        key = await keys.revoke(key_id, org_id=org_id)
        # Commit before telling the gateways, so the record they re-read is the revoked one.
        await keys.repository.session.commit()
        await request.app.state.bus.publish(KEYS, KeysChanged(prefix=key.prefix))
        return _key_out(key)
