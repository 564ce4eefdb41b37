"""Admin API of organisations, users and API keys (HTTP only: the rules are the services')."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from control_plane.orgs.keys import ApiKeyService, CreatedKey
from control_plane.orgs.schemas import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyOut,
    ApiKeyUpdate,
    OrganizationCreate,
    OrganizationOut,
    OrganizationUpdate,
    UserCreate,
    UserOut,
    UserUpdate,
)
from control_plane.orgs.services import OrganizationService, UserService
from control_plane.paging import LIST_PAGE, PageQuery, link_header
from control_plane.policy import Principal
from control_plane.wire import out
from tokenmill.settings import Settings


def created_key(created: CreatedKey) -> ApiKeyCreated:
    return msgspec.structs.replace(out(created.key, ApiKeyCreated), secret=created.secret)


class OrganizationController(Controller):
    path = "/organizations"
    tags = ["Admin: organisations"]

    @get(dependencies=LIST_PAGE)
    async def list_organizations(
        self,
        request: Request[Any, Any, Any],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        page: NamedDependency[PageQuery],
    ) -> Response[list[OrganizationOut]]:
        """Oldest first; `q` searches names. With `limit`, one page (`Link` names the next)."""
        found = await orgs.page_visible(admin, page)
        return Response(
            [out(o, OrganizationOut) for o in found.rows], headers=link_header(str(request.url), found)
        )

    @post()
    async def create_organization(
        self,
        data: JSONBody[OrganizationCreate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        return out(await orgs.create_org(data.name, plan_id=data.plan_id, actor=admin), OrganizationOut)

    @get("/{org_id:str}")
    async def get_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        return out(await orgs.visible(org_id, admin), OrganizationOut)

    @patch("/{org_id:str}")
    async def update_organization(
        self,
        org_id: FromPath[str],
        data: JSONBody[OrganizationUpdate],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        """Rename (its own admins may), assign a plan (`plan_id`, null for the default tier)
        or set how Stripe bills it (`billing_mode`); the last two for platform admins only."""
        org = await orgs.visible(org_id, admin)
        return out(await orgs.update_org(org, data, admin), OrganizationOut)

    @post("/{org_id:str}/suspend", status_code=200)
    async def suspend_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        """Its keys, admins and dashboard users are refused (403 organization_suspended; its
        invoices and usage stay readable) and its deployments scale to zero, until resumed."""
        await orgs.suspend(org_id, admin)
        return out(await orgs.visible(org_id, admin), OrganizationOut)

    @post("/{org_id:str}/resume", status_code=200)
    async def resume_organization(
        self,
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
    ) -> OrganizationOut:
        """Its keys work again and its deployments come back with the replicas they had."""
        await orgs.resume(org_id, admin)
        return out(await orgs.visible(org_id, admin), OrganizationOut)


class UserController(Controller):
    path = "/"
    tags = ["Admin: users"]

    @get("/organizations/{org_id:str}/users", dependencies=LIST_PAGE)
    async def list_users(
        self,
        request: Request[Any, Any, Any],
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        users: NamedDependency[UserService],
        page: NamedDependency[PageQuery],
    ) -> Response[list[UserOut]]:
        """Oldest first; `q` searches emails. With `limit`, one page (`Link` names the next)."""
        org = await orgs.visible(org_id, admin)
        found = await users.page_for_org(org.id, page)
        return Response([out(u, UserOut) for u in found.rows], headers=link_header(str(request.url), found))

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
        return out(user, UserOut)

    @get("/users/{user_id:str}")
    async def get_user(
        self, user_id: FromPath[str], admin: NamedDependency[Principal], users: NamedDependency[UserService]
    ) -> UserOut:
        return out(await users.visible(user_id, admin), UserOut)

    @patch("/users/{user_id:str}")
    async def update_user(
        self,
        user_id: FromPath[str],
        data: JSONBody[UserUpdate],
        admin: NamedDependency[Principal],
        users: NamedDependency[UserService],
    ) -> UserOut:
        """Change role or password, or disable (which revokes the user's API keys) / enable."""
        user = await users.visible(user_id, admin)
        await users.update_user(user, data, admin)
        return out(user, UserOut)


class ApiKeyController(Controller):
    path = "/"
    tags = ["Admin: API keys"]

    @get("/organizations/{org_id:str}/keys", dependencies=LIST_PAGE)
    async def list_keys(
        self,
        request: Request[Any, Any, Any],
        org_id: FromPath[str],
        admin: NamedDependency[Principal],
        orgs: NamedDependency[OrganizationService],
        keys: NamedDependency[ApiKeyService],
        page: NamedDependency[PageQuery],
    ) -> Response[list[ApiKeyOut]]:
        """Oldest first (`order=desc`: newest first); `q` searches names and prefixes. With
        `limit`, one page (`Link` names the next)."""
        org = await orgs.visible(org_id, admin)
        found = await keys.page_for_org(org.id, page)
        return Response([out(k, ApiKeyOut) for k in found.rows], headers=link_header(str(request.url), found))

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
        return created_key(created)

    @get("/keys/{key_id:str}")
    async def get_key(
        self, key_id: FromPath[str], admin: NamedDependency[Principal], keys: NamedDependency[ApiKeyService]
    ) -> ApiKeyOut:
        return out(await keys.visible(key_id, admin), ApiKeyOut)

    @patch("/keys/{key_id:str}")
    async def update_key(
        self,
        key_id: FromPath[str],
        data: JSONBody[ApiKeyUpdate],
        admin: NamedDependency[Principal],
        keys: NamedDependency[ApiKeyService],
    ) -> ApiKeyOut:
        """Name, scopes, expiry and per-key limits; null clears a limit or the expiry."""
        key = await keys.visible(key_id, admin)
        return out(await keys.update_key(key, data, admin), ApiKeyOut)

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(
        self, key_id: FromPath[str], admin: NamedDependency[Principal], keys: NamedDependency[ApiKeyService]
    ) -> ApiKeyOut:
        """Refused by every gateway within a second."""
        return out(await keys.revoke(key_id, actor=admin), ApiKeyOut)

    @post("/keys/{key_id:str}/rotate")
    async def rotate_key(
        self,
        key_id: FromPath[str],
        admin: NamedDependency[Principal],
        keys: NamedDependency[ApiKeyService],
        settings: NamedDependency[Settings],
    ) -> ApiKeyCreated:
        """A new secret with the same name, scopes, expiry and limits; the old key is revoked
        at once, everywhere."""
        key = await keys.visible(key_id, admin)
        return created_key(await keys.rotate(key, secret_key=settings.secret_key or "", actor=admin))
