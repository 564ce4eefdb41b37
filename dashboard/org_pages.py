"""The dashboard's organisation, user and API key pages (HTTP only: the rules are the control
plane's services')."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from control_plane.orgs.keys import CreatedKey
from control_plane.orgs.schemas import OrganizationUpdate, UserUpdate
from control_plane.policy import (
    grantable_roles,
)
from control_plane.unit import UnitOfWork
from control_plane.wire import parse
from dashboard import PREFIX
from dashboard.lists import Pager, list_query
from dashboard.services import PRESETS, key_activity, org_names, window
from dashboard.web import (
    admin_of,
    attempt,
    back,
    flash,
    form_fields,
    form_int,
    org_for_write,
    page,
)
from tokenmill.errors import APIError

# --- organisations and users ----------------------------------------------------------------


@get("/orgs")
async def organizations(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Response[Any]:
    admin = admin_of(request)
    if not admin.is_platform_admin:
        return Redirect(f"{PREFIX}/orgs/{admin.org_id}", status_code=303)
    query = list_query(q, after, before)
    found = await uow.orgs.page_visible(admin, query)
    plans = {p.id: p.name for p in await uow.plans.list_plans()}
    pager = Pager("/orgs", query, found, "organisations")
    return page(request, "orgs.html", title="Organisations", current="orgs", pager=pager, plans=plans)


@post("/orgs")
async def create_organization(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    async def act() -> str:
        org = await uow.orgs.create_org(fields.get("name", ""), actor=admin)
        return f"Created organisation {org.name}."

    return await attempt(request, uow, "/orgs", act)


@get("/orgs/{org_id:str}")
async def organization(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org_id: FromPath[str],
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org = await uow.orgs.visible(org_id, admin)
    query = list_query(q, after, before)
    pager = Pager(f"/orgs/{org.id}", query, await uow.users.page_for_org(org.id, query), "users")
    plans = await uow.plans.list_plans()
    roles = grantable_roles(admin)
    return page(
        request,
        "org.html",
        title=org.name,
        current="orgs",
        org=org,
        pager=pager,
        plans=plans,
        plan=next((p for p in plans if p.id == org.plan_id), None),
        roles=roles,
    )


@post("/orgs/{org_id:str}/plan")
async def assign_plan(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], org_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    orgs = uow.orgs
    org = await orgs.visible(org_id, admin)

    async def act() -> str:
        await orgs.update_org(org, OrganizationUpdate(plan_id=fields.get("plan_id") or None), admin)
        return "Plan updated; gateways apply its limits within a second."

    return await attempt(request, uow, f"/orgs/{org_id}", act)


@post("/orgs/{org_id:str}/status")
async def set_org_status(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], org_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    orgs = uow.orgs
    org = await orgs.visible(org_id, admin)

    async def act() -> str:
        if fields.get("status") == "suspended":
            await orgs.suspend(org.id, admin)
        else:
            await orgs.resume(org.id, admin)
        return f"{org.name} is {org.status}."

    return await attempt(request, uow, f"/orgs/{org_id}", act)


@post("/orgs/{org_id:str}/users")
async def create_user(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], org_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)

    org = await uow.orgs.visible(org_id, admin)

    async def act() -> str:
        password = fields.get("password", "")
        if len(password) < 8:
            raise APIError(400, "The password needs at least 8 characters.", param="password")
        user = await uow.users.create_user(
            org_id=org.id,
            email=fields.get("email", ""),
            password=password,
            role=fields.get("role") or "member",
            actor=admin,
        )
        return f"Created user {user.email}."

    return await attempt(request, uow, f"/orgs/{org_id}", act)


@post("/users/{user_id:str}")
async def update_user(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], user_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)
    users = uow.users
    user = await users.visible(user_id, admin)

    async def act() -> str:
        change: dict[str, Any] = {}
        if fields.get("role"):
            change["role"] = fields["role"]
        if fields.get("disabled") in ("true", "false"):
            change["disabled"] = fields["disabled"] == "true"
        revoked = await users.update_user(user, parse(change, UserUpdate), admin)
        note = f" and revoked {len(revoked)} of their keys" if revoked else ""
        return f"Updated {user.email}{note}."

    return await attempt(request, uow, f"/orgs/{user.org_id}", act)


# --- API keys -------------------------------------------------------------------------------


def _key_status(key: Any, now: datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at.replace(tzinfo=key.expires_at.tzinfo or UTC) <= now:
        return "expired"
    return "active"


@get("/keys")
async def keys(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    range: FromQuery[str | None] = None,
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await org_for_write(uow, admin, org)
    now = datetime.now(UTC)
    query = list_query(q, after, before, "desc")  # newest first: a new key is on the first page
    found = await uow.keys.page_for_org(org_id, query)
    pager = Pager("/keys", query, found, "keys", {"org": org_id, "range": range or ""})
    rows = [(k, _key_status(k, now)) for k in found.rows]
    users = await uow.users.emails(org_id, (k.user_id for k in found.rows if k.user_id))
    # Requests, tokens and spend of the listed keys over a preset range, in one query.
    activity_window = window(range if range in PRESETS else "30d")
    activity = await key_activity(uow.session, activity_window, org_id, [k.id for k, _ in rows])
    kept = {k: v for k, v in request.query_params.items() if k != "range"}
    activity_links = {p: urlencode(kept | {"range": p}) for p in PRESETS}
    return page(
        request,
        "keys.html",
        title="API keys",
        current="keys",
        org_id=org_id,
        orgs=await org_names(uow.session, admin),
        keys=rows,
        users=users,
        roles=grantable_roles(admin),
        activity=activity,
        activity_window=activity_window,
        activity_links=activity_links,
        pager=pager,
    )


# A new key's secret waits for the one page that shows it in the encrypted message cookie
# (never in a URL or on the server); that page takes it out, so a reload shows it no more.
NEW_SECRET = "new_key"


def _created(request: Request[Any, Any, Any], created: CreatedKey, verb: str) -> Redirect:
    request.session[NEW_SECRET] = {"id": created.key.id, "secret": created.secret, "verb": verb}
    return back(f"/keys/{created.key.id}/created")


@get("/keys/{key_id:str}/created")
async def key_created(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], key_id: FromPath[str]
) -> Template:
    """Where creating or rotating a key lands (post/redirect/get): its secret, the first time."""
    key = await uow.keys.visible(key_id, admin_of(request))
    held = request.session.get(NEW_SECRET)
    shown = held if isinstance(held, dict) and held.get("id") == key.id else None
    if shown is not None:
        request.session.pop(NEW_SECRET)
    return page(
        request,
        "key_created.html",
        title="Your new API key" if shown else "API key",
        current="keys",
        key=key,
        secret=shown["secret"] if shown else None,
        verb=shown["verb"] if shown else "created",
    )


@post("/keys")
async def create_key(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)
    org_id = await org_for_write(uow, admin, fields.get("org"))
    try:
        scopes = [s.strip() for s in fields.get("scopes", "").split(",") if s.strip()] or None
        expires = fields.get("expires_at")
        created = await uow.keys.create_key(
            org_id=org_id,
            secret_key=request.app.state.settings.secret_key or "",
            name=fields.get("name", "")[:200],
            role=fields.get("role") or "member",
            scopes=scopes,
            expires_at=datetime.fromisoformat(expires).replace(tzinfo=UTC) if expires else None,
            limits={
                "requests_per_minute": form_int(fields.get("requests_per_minute"), "requests_per_minute"),
                "tokens_per_minute": form_int(fields.get("tokens_per_minute"), "tokens_per_minute"),
            },
            actor=admin,
        )
    except (APIError, ValueError) as exc:
        await uow.rollback()
        flash(request, "error", exc.message if isinstance(exc, APIError) else f"Invalid value: {exc}")
        return back(f"/keys?org={org_id}")
    return _created(request, created, "created")


@post("/keys/{key_id:str}/revoke")
async def revoke_key(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], key_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    found = await uow.keys.visible(key_id, admin)

    async def act() -> str:
        key = await uow.keys.revoke(key_id, actor=admin)  # announced once committed
        return f"Revoked key {key.prefix}…; the gateways refuse it from now on."

    return await attempt(request, uow, f"/keys?org={found.org_id}", act)


@post("/keys/{key_id:str}/rotate")
async def rotate_key(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], key_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    service = uow.keys
    key = await service.visible(key_id, admin)
    try:
        created = await service.rotate(
            key, secret_key=request.app.state.settings.secret_key or "", actor=admin
        )
    except APIError as exc:
        await uow.rollback()
        flash(request, "error", exc.message)
        return back(f"/keys?org={key.org_id}")
    return _created(request, created, "rotated")
