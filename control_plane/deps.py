"""What admin endpoints are given (Litestar dependency injection): who is calling, the unit
of work of the request, and its services.

The composition root provides `uow` and `db_session` for the whole app (`UNIT_DEPENDENCIES`):
one session per request, inside one unit of work, whichever package's endpoint (the control
plane's or billing's) handles it. Litestar cleans generator dependencies up concurrently, so
the request's session is the unit's, never a second generator beside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.services import AuditService
from control_plane.catalog.adapters import AdapterService
from control_plane.catalog.deployments import DeploymentService
from control_plane.catalog.services import ModelService
from control_plane.orgs.keys import ApiKeyService, authenticate
from control_plane.orgs.services import OrganizationService, UserService
from control_plane.plans.services import PlanService
from control_plane.policy import OPEN_WHILE_SUSPENDED, Principal, admit
from control_plane.unit import UnitOfWork
from tokenmill.clients import auth_failures
from tokenmill.errors import APIError
from tokenmill.settings import Settings

# --- who is calling ------------------------------------------------------------------------


async def authenticate_admin(
    connection: ASGIConnection[Any, Any, Any, Any], *, while_suspended: bool
) -> Principal:
    """The one place an admin API caller is identified: an admin API key in
    `Authorization: Bearer`, of an admin role and an organisation that is not suspended
    (control_plane.policy.admit)."""
    scheme, _, secret = (connection.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise APIError(
            401, "Admin endpoints need 'Authorization: Bearer <admin key>'.", code="invalid_api_key"
        )
    state = connection.app.state
    # An address that keeps failing gets 429 before any further database read.
    with auth_failures(connection):
        async with state.sessionmaker() as session:
            key, org = await authenticate(session, secret.strip(), state.settings.secret_key)
    return admit(
        key.role, key.org_id, org, while_suspended=while_suspended, key_id=key.id, user_id=key.user_id
    )


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard of every admin route (billing's included): who it is, kept for `provide_admin`.
    Routes that only read invoices or usage say so in their `opt` (policy.WHILE_SUSPENDED)."""
    while_suspended = bool(handler.opt.get(OPEN_WHILE_SUSPENDED))
    connection.state.admin = await authenticate_admin(connection, while_suspended=while_suspended)


def provide_admin(request: Request[Any, Any, Any]) -> Principal:
    return request.state.admin


# --- the unit of work and its services ---------------------------------------------------------


async def provide_uow(state: State) -> AsyncIterator[UnitOfWork]:
    """The request's unit of work: committed (and its events delivered) when the handler
    returns, rolled back when it raises."""
    async with UnitOfWork.open(state.sessionmaker, catalog=state.catalog, publisher=state.bus) as unit:
        yield unit


def provide_db_session(uow: NamedDependency[UnitOfWork]) -> AsyncSession:
    return uow.session


def provide_settings(state: State) -> Settings:
    return state.settings


def provide_orgs(uow: NamedDependency[UnitOfWork]) -> OrganizationService:
    return uow.orgs


def provide_users(uow: NamedDependency[UnitOfWork]) -> UserService:
    return uow.users


def provide_keys(uow: NamedDependency[UnitOfWork]) -> ApiKeyService:
    return uow.keys


def provide_models(uow: NamedDependency[UnitOfWork]) -> ModelService:
    return uow.models


def provide_deployments(uow: NamedDependency[UnitOfWork]) -> DeploymentService:
    return uow.deployments


def provide_adapters(uow: NamedDependency[UnitOfWork]) -> AdapterService:
    return uow.adapters


def provide_plans(uow: NamedDependency[UnitOfWork]) -> PlanService:
    return uow.plans


def provide_audit(uow: NamedDependency[UnitOfWork]) -> AuditService:
    return uow.audit


UNIT_DEPENDENCIES = {
    "uow": Provide(provide_uow),
    "db_session": Provide(provide_db_session, sync_to_thread=False),
}

ADMIN_DEPENDENCIES = {
    "admin": Provide(provide_admin, sync_to_thread=False),
    "settings": Provide(provide_settings, sync_to_thread=False),
    "orgs": Provide(provide_orgs, sync_to_thread=False),
    "users": Provide(provide_users, sync_to_thread=False),
    "keys": Provide(provide_keys, sync_to_thread=False),
    "models": Provide(provide_models, sync_to_thread=False),
    "deployments": Provide(provide_deployments, sync_to_thread=False),
    "adapters": Provide(provide_adapters, sync_to_thread=False),
    "plans": Provide(provide_plans, sync_to_thread=False),
    "audit": Provide(provide_audit, sync_to_thread=False),
}
