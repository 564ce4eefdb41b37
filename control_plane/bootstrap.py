"""The first start (an organisation and a platform-admin key) and every start (the served
models in the catalogue, with their serverless deployments)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.catalog.models import Deployment, Model
from control_plane.catalog.services import CatalogService
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import Organization, User
from control_plane.orgs.services import OrganizationService, UserService


@dataclass(slots=True)
class EmbedSpec:
    """An embedding model the embedded server serves next to its chat model."""

    name: str
    source: str
    context_length: int
    format: str = "hf"


@dataclass(slots=True)
class Bootstrap:
    org: Organization
    admin_secret: str | None  # only on the very first start
    deployment: Deployment
    model: Model
    embed_deployment: Deployment | None = None
    embed_model: Model | None = None
    # (email, password) of a platform admin created for the dashboard's sign-in when no
    # platform admin could sign in yet; the password is shown once, like the key.
    admin_login: tuple[str, str] | None = None


async def _ensure_admin_login(session: AsyncSession, org_id: str, email: str) -> tuple[str, str] | None:
    """A platform-admin user with a generated password, unless one can already sign in (or
    the address is taken, e.g. by a disabled user: then it is the admins' call)."""
    can_sign_in = select(User.id).where(
        User.role == "platform_admin", User.password_hash.is_not(None), User.disabled.is_(False)
    )
    users = UserService(session=session)
    if await session.scalar(can_sign_in.limit(1)) is not None or await users.exists(email=email):
        return None
    password = secrets.token_urlsafe(18)
    user = await users.create_user(org_id=org_id, email=email, password=password, role="platform_admin")
    return user.email, password


async def bootstrap(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    secret_key: str,
    model_name: str,
    model_source: str,
    model_format: str,
    context_length: int,
    sampling: dict[str, float] | None = None,
    embed: EmbedSpec | None = None,
    dashboard_admin: str | None = None,
) -> Bootstrap:
    """First start: an organisation and a platform-admin key. Every start: the served model,
    and the embedding model (kind `embed`) with its serverless deployment when `embed` is given;
    with `dashboard_admin` (an email), a platform-admin user to sign in to the dashboard with,
    if no platform admin can sign in yet. Nothing is running yet to be told of any of it."""
    async with sessionmaker() as session, session.begin():
        orgs = OrganizationService(session=session)
        secret = None
        org = await orgs.get_one_or_none(name="default")
        if await orgs.count() == 0:
            org = await orgs.create_org("default")
            created = await ApiKeyService(session=session).create_key(
                org_id=org.id, secret_key=secret_key, name="bootstrap admin", role="platform_admin"
            )
            secret = created.secret
        elif org is None:
            org = (await orgs.get_many(order_by=[(Organization.created_at, False)]))[0]
        catalog = CatalogService(session)
        model = await catalog.ensure_model(
            name=model_name,
            source=model_source,
            format=model_format,
            kind="generate",
            context_length=context_length,
        )
        dep = await catalog.ensure_serverless(model, sampling)
        embed_model = embed_dep = None
        if embed is not None:
            embed_model = await catalog.ensure_model(
                name=embed.name,
                source=embed.source,
                format=embed.format,
                kind="embed",
                context_length=embed.context_length,
            )
            embed_dep = await catalog.ensure_serverless(embed_model)
        login = await _ensure_admin_login(session, org.id, dashboard_admin) if dashboard_admin else None
    return Bootstrap(
        org=org,
        admin_secret=secret,
        deployment=dep,
        model=model,
        embed_deployment=embed_dep,
        embed_model=embed_model,
        admin_login=login,
    )
