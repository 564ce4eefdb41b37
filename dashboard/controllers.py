"""The dashboard's pages and forms (HTTP only: reads are in services.py, writes go through
the control plane's and billing's services, which check roles and write the audit log).

Forms post back and redirect (303) with a one-line message in the session, so reloading a
page never repeats a change; the two exceptions render a new API key's secret directly, the
only time it is ever shown. Where the admin API checks a role in its controller rather than
in a service (platform-only operations), the same check is made here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Stream, Template
from sqlalchemy.ext.asyncio import AsyncSession

from billing.services import PriceBook, get_invoice, list_invoices
from control_plane.controllers import AdapterUpload, announce, read_adapter_upload
from control_plane.models import ROLES, Model, Plan
from control_plane.schemas import (
    DeploymentCreate,
    DeploymentUpdate,
    OrganizationUpdate,
    PlanCreate,
    UserUpdate,
)
from control_plane.services import (
    AdapterService,
    ApiKeyService,
    CreatedKey,
    DeploymentService,
    ModelService,
    OrganizationService,
    PlanService,
    Principal,
    UserService,
    record_change,
    remove_adapter_files,
)
from dashboard import PREFIX, charts
from dashboard.auth import check_csrf, check_login_rate, require_login, start_session
from dashboard.fleet import LiveWorker
from dashboard.services import (
    PRESETS,
    Series,
    UsageFilter,
    invoice_csv,
    invoice_json,
    org_names,
    org_statuses,
    scope_org,
    usage_csv,
    usage_series,
    window,
)
from tokenmill.bodies import Form
from tokenmill.clients import client_address, trusted_networks
from tokenmill.errors import APIError
from tokenmill.protocol import KeysChanged

# --- page plumbing --------------------------------------------------------------------------

NAV = (
    ("overview", "/", "Overview"),
    ("orgs", "/orgs", "Organisations"),
    ("keys", "/keys", "API keys"),
    ("models", "/models", "Models & adapters"),
    ("deployments", "/deployments", "Deployments"),
    ("usage", "/usage", "Usage"),
    ("invoices", "/invoices", "Invoices"),
    ("prices", "/prices", "Prices & plans"),
)


def _admin(request: Request[Any, Any, Any]) -> Principal:
    return request.state.admin


def _nav(admin: Principal, current: str) -> list[dict[str, Any]]:
    items = []
    for key, path, label in NAV:
        if key == "orgs" and not admin.is_platform_admin:
            # An organisation admin has one organisation: link straight to it.
            path, label = f"/orgs/{admin.org_id}", "Organisation"
        items.append({"path": path, "label": label, "current": key == current})
    return items


def flash(request: Request[Any, Any, Any], kind: str, text: str) -> None:
    """A message for the next page (kind `ok` or `error`), kept in the session cookie."""
    request.session.setdefault("flash", []).append([kind, text])


def page(
    request: Request[Any, Any, Any], template: str, *, title: str, current: str, **context: Any
) -> Template:
    admin = _admin(request)
    messages = request.session.pop("flash", [])
    return Template(
        template,
        context={
            "base": PREFIX,
            "title": title,
            "admin": admin,
            "user": request.state.user,
            "role_label": admin.role.replace("_", " "),
            "nav": _nav(admin, current),
            "flashes": messages,
            **context,
        },
    )


def back(path: str) -> Redirect:
    return Redirect(PREFIX + path, status_code=303)


async def form_fields(request: Request[Any, Any, Any]) -> dict[str, str]:
    data = await request.form()
    return {k: v.strip() for k, v in data.items() if isinstance(v, str)}


async def attempt(
    request: Request[Any, Any, Any], db: AsyncSession, to: str, action: Callable[[], Awaitable[str]]
) -> Redirect:
    """Run a change; either way back to `to`, with what happened as the page's message."""
    try:
        message = await action()
    except APIError as exc:
        await db.rollback()  # nothing half-done is committed when the request ends
        flash(request, "error", exc.message)
        return back(to)
    flash(request, "ok", message)
    return back(to)


def convert(data: dict[str, Any], kind: type[Any]) -> Any:
    """A form as one of the admin API's bodies, with the API's validation (400 naming the
    field, like the API's own errors)."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid value: {exc}") from None


def _int(value: str | None, param: str) -> int | None:
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"{param} must be a whole number.", param=param) from None


def _decimal(value: str | None, param: str) -> Decimal | None:
    if not value:
        return None
    try:
        return Decimal(value)
    except InvalidOperation:
        raise APIError(400, f"{param} must be a number.", param=param) from None


def _roles(admin: Principal) -> list[str]:
    """Roles the admin may give, least powerful first (the forms' default)."""
    return [r for r in reversed(ROLES) if admin.is_platform_admin or r != "platform_admin"]


def _platform_only(admin: Principal, what: str) -> None:
    if not admin.is_platform_admin:
        raise APIError(403, f"Only platform admins {what}.", code="insufficient_permissions")


async def _org_for_write(db: AsyncSession, admin: Principal, ref: str | None) -> str:
    """The organisation a form acts on: the one named if visible, else the admin's own."""
    org_id = await scope_org(db, admin, ref or admin.org_id)
    if org_id is None:
        raise APIError(400, "Choose an organisation.", param="org")
    return org_id


# --- login ----------------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    # Only back into the dashboard: never an open redirect to another site.
    if target and target.startswith(PREFIX + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return PREFIX + "/"


def _login_page(error: str | None = None, status: int = 200, email: str = "", next_: str = "") -> Template:
    return Template(
        "login.html",
        context={"base": PREFIX, "title": "Sign in", "error": error, "email": email, "next": next_},
        status_code=status,
    )


@get("/login", name="login")
async def login_form(request: Request[Any, Any, Any], next: FromQuery[str | None] = None) -> Response[Any]:
    if (request.session or {}).get("uid"):
        return Redirect(_safe_next(next), status_code=303)
    return _login_page(next_=_safe_next(next))


@post("/login", status_code=200)
async def login(request: Request[Any, Any, Any]) -> Response[Any]:
    fields = await form_fields(request)
    email, password = fields.get("email", ""), (await request.form()).get("password") or ""
    target = _safe_next(fields.get("next"))
    state = request.app.state
    address = client_address(request.scope, trusted_networks(state.settings.trusted_proxies))
    wait = await check_login_rate(state.limiter, state.dashboard_settings, address, email)
    if wait:
        response = _login_page(
            f"Too many sign-in attempts; try again in {int(wait) + 1} seconds.", 429, email, target
        )
        response.headers["retry-after"] = str(int(wait) + 1)
        return response
    async with state.sessionmaker() as db:
        user = await UserService(session=db).authenticate(email, str(password))
    if user is None:
        return _login_page("Incorrect email or password.", 401, email, target)
    if user.role not in ("platform_admin", "org_admin"):
        return _login_page(
            "The dashboard is for platform and organisation admins; members use API keys.", 403, email
        )
    start_session(request, user)
    return Redirect(target, status_code=303)


@post("/logout", guards=[require_login], status_code=200)
async def logout(request: Request[Any, Any, Any]) -> Redirect:
    request.scope["session"] = {}
    return Redirect(PREFIX + "/login", status_code=303)


# --- overview -------------------------------------------------------------------------------


def usage_charts(series: Series, prefix: str) -> list[dict[str, Any]]:
    """The charts of a usage series: requests, tokens, spend (when known) and error rate."""
    hourly = series.window.hourly

    def points(value: Callable[[Any], float]) -> list[charts.Point]:
        return [charts.Point(b.at, value(b)) for b in series.buckets]

    out = [
        ("requests", "Requests", points(lambda b: b.requests), "bar", charts.compact),
        ("tokens", "Tokens (prompt + completion)", points(lambda b: b.tokens), "bar", charts.compact),
    ]
    if series.spend_known:
        currency = series.currency.upper()
        out.append(
            (
                "spend",
                f"Spend ({currency}, from hourly rollups)",
                points(lambda b: float(b.spend or 0)),
                "bar",
                lambda v: f"{v:,.2f}",
            )
        )
    out.append(("errors", "Error rate", points(lambda b: b.error_rate), "line", lambda v: f"{v * 100:.1f}%"))
    return [
        {
            "id": f"{prefix}-{key}",
            "title": title,
            "svg": charts.render(
                pts, chart_id=f"{prefix}-{key}", title=title, hourly=hourly, kind=kind, fmt=fmt
            ),
        }
        for key, title, pts, kind, fmt in out
    ]


def _fleet_rows(
    request: Request[Any, Any, Any], deployments: list[Any], admin: Principal
) -> tuple[list[dict[str, Any]], list[LiveWorker]]:
    """Per deployment: live workers and their load. Organisation admins see the workers of
    their own deployments; of shared ones, only how many serve."""
    workers = request.app.state.fleet.snapshot({d.id for d in deployments})
    own = {d.id for d in deployments if admin.is_platform_admin or d.org_id == admin.org_id}
    rows = []
    for dep in deployments:
        mine = [w for w in workers if w.deployment_id == dep.id]
        live = [w for w in mine if w.live]
        rows.append(
            {
                "dep": dep,
                "live": len(live),
                "lost": len(mine) - len(live),
                "detail": dep.id in own,
                "running": sum(w.running for w in live),
                "waiting": sum(w.waiting for w in live),
                "kv": (sum(w.kv_usage for w in live) / len(live)) if live else None,
            }
        )
    return rows, [w for w in workers if w.deployment_id in own]


@get("/")
async def overview(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    range: FromQuery[str | None] = None,
) -> Template:
    admin = _admin(request)
    org_id = await scope_org(db_session, admin, None)
    win = window(range)
    series = await usage_series(db_session, win, UsageFilter(org_id=org_id))
    deployments = await DeploymentService(session=db_session).list_visible(admin)
    fleet, _ = _fleet_rows(request, deployments, admin)
    statuses = await org_statuses(db_session, None if admin.is_platform_admin else [admin.org_id or ""])
    return page(
        request,
        "overview.html",
        title="Overview",
        current="overview",
        series=series,
        charts=usage_charts(series, "overview"),
        presets=list(PRESETS),
        win=win,
        fleet=fleet,
        statuses=statuses,
    )


# --- organisations and users ----------------------------------------------------------------


@get("/orgs")
async def organizations(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Response[Any]:
    admin = _admin(request)
    if not admin.is_platform_admin:
        return Redirect(f"{PREFIX}/orgs/{admin.org_id}", status_code=303)
    orgs = await OrganizationService(session=db_session).list_visible(admin)
    plans = {p.id: p.name for p in await PlanService(session=db_session).get_many()}
    return page(request, "orgs.html", title="Organisations", current="orgs", orgs=orgs, plans=plans)


@post("/orgs")
async def create_organization(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    async def act() -> str:
        _platform_only(admin, "create organisations")
        org = await OrganizationService(session=db_session).create_org(fields.get("name", ""), actor=admin)
        return f"Created organisation {org.name}."

    return await attempt(request, db_session, "/orgs", act)


@get("/orgs/{org_id:str}")
async def organization(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], org_id: FromPath[str]
) -> Template:
    admin = _admin(request)
    org = await OrganizationService(session=db_session).visible(org_id, admin)
    users = await UserService(session=db_session).list_for_org(org.id)
    plans = list(await PlanService(session=db_session).get_many(order_by=[(Plan.name, False)]))
    roles = _roles(admin)
    return page(
        request,
        "org.html",
        title=org.name,
        current="orgs",
        org=org,
        users=users,
        plans=plans,
        plan=next((p for p in plans if p.id == org.plan_id), None),
        roles=roles,
    )


@post("/orgs/{org_id:str}/plan")
async def assign_plan(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], org_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    orgs = OrganizationService(session=db_session)
    org = await orgs.visible(org_id, admin)

    async def act() -> str:
        _platform_only(admin, "assign plans")
        if await orgs.update_org(org, OrganizationUpdate(plan_id=fields.get("plan_id") or None), admin):
            await announce(db_session, request.app.state.bus, [KeysChanged(org_id=org.id)])
        return "Plan updated; gateways apply its limits within a second."

    return await attempt(request, db_session, f"/orgs/{org_id}", act)


@post("/orgs/{org_id:str}/status")
async def set_org_status(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], org_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    orgs = OrganizationService(session=db_session)
    org = await orgs.visible(org_id, admin)

    async def act() -> str:
        _platform_only(admin, "suspend or resume organisations")
        status = "suspended" if fields.get("status") == "suspended" else "active"
        await orgs.set_status(org, status, admin)
        await announce(db_session, request.app.state.bus, [KeysChanged(org_id=org.id)])
        return f"{org.name} is {status}."

    return await attempt(request, db_session, f"/orgs/{org_id}", act)


@post("/orgs/{org_id:str}/users")
async def create_user(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], org_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    org = await OrganizationService(session=db_session).visible(org_id, admin)

    async def act() -> str:
        password = fields.get("password", "")
        if len(password) < 8:
            raise APIError(400, "The password needs at least 8 characters.", param="password")
        user = await UserService(session=db_session).create_user(
            org_id=org.id,
            email=fields.get("email", ""),
            password=password,
            role=fields.get("role") or "member",
            actor=admin,
        )
        return f"Created user {user.email}."

    return await attempt(request, db_session, f"/orgs/{org_id}", act)


@post("/users/{user_id:str}")
async def update_user(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], user_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)
    users = UserService(session=db_session)
    user = await users.visible(user_id, admin)

    async def act() -> str:
        change: dict[str, Any] = {}
        if fields.get("role"):
            change["role"] = fields["role"]
        if fields.get("disabled") in ("true", "false"):
            change["disabled"] = fields["disabled"] == "true"
        revoked = await users.update_user(user, convert(change, UserUpdate), admin)
        if revoked:
            await announce(db_session, request.app.state.bus, [KeysChanged(prefix=p) for p in revoked])
        note = f" and revoked {len(revoked)} of their keys" if revoked else ""
        return f"Updated {user.email}{note}."

    return await attempt(request, db_session, f"/orgs/{user.org_id}", act)


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
    db_session: NamedDependency[AsyncSession],
    org: FromQuery[str | None] = None,
) -> Template:
    admin = _admin(request)
    org_id = await _org_for_write(db_session, admin, org)
    now = datetime.now(UTC)
    rows = [(k, _key_status(k, now)) for k in await ApiKeyService(session=db_session).list_for_org(org_id)]
    users = {u.id: u.email for u in await UserService(session=db_session).list_for_org(org_id)}
    return page(
        request,
        "keys.html",
        title="API keys",
        current="keys",
        org_id=org_id,
        orgs=await org_names(db_session, admin),
        keys=rows,
        users=users,
        roles=_roles(admin),
    )


def _created(request: Request[Any, Any, Any], created: CreatedKey, verb: str) -> Template:
    return page(
        request,
        "key_created.html",
        title="Your new API key",
        current="keys",
        key=created.key,
        secret=created.secret,
        verb=verb,
    )


@post("/keys", status_code=200)
async def create_key(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Response[Any]:
    admin = _admin(request)
    fields = await form_fields(request)
    org_id = await _org_for_write(db_session, admin, fields.get("org"))
    try:
        scopes = [s.strip() for s in fields.get("scopes", "").split(",") if s.strip()] or None
        expires = fields.get("expires_at")
        created = await ApiKeyService(session=db_session).create_key(
            org_id=org_id,
            secret_key=request.app.state.settings.secret_key or "",
            name=fields.get("name", "")[:200],
            role=fields.get("role") or "member",
            scopes=scopes,
            expires_at=datetime.fromisoformat(expires).replace(tzinfo=UTC) if expires else None,
            limits={
                "requests_per_minute": _int(fields.get("requests_per_minute"), "requests_per_minute"),
                "tokens_per_minute": _int(fields.get("tokens_per_minute"), "tokens_per_minute"),
            },
            actor=admin,
        )
    except (APIError, ValueError) as exc:
        await db_session.rollback()
        flash(request, "error", exc.message if isinstance(exc, APIError) else f"Invalid value: {exc}")
        return back(f"/keys?org={org_id}")
    return _created(request, created, "created")


@post("/keys/{key_id:str}/revoke")
async def revoke_key(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], key_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    found = await ApiKeyService(session=db_session).visible(key_id, admin)

    async def act() -> str:
        key = await ApiKeyService(session=db_session).revoke(
            key_id, org_id=None if admin.is_platform_admin else admin.org_id, actor=admin
        )
        # Committed, then announced: gateways drop the key within a second.
        await announce(db_session, request.app.state.bus, [KeysChanged(prefix=key.prefix)])
        return f"Revoked key {key.prefix}…; the gateways refuse it from now on."

    return await attempt(request, db_session, f"/keys?org={found.org_id}", act)


@post("/keys/{key_id:str}/rotate", status_code=200)
async def rotate_key(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], key_id: FromPath[str]
) -> Response[Any]:
    admin = _admin(request)
    service = ApiKeyService(session=db_session)
    key = await service.visible(key_id, admin)
    try:
        created = await service.rotate(
            key, secret_key=request.app.state.settings.secret_key or "", actor=admin
        )
        await announce(db_session, request.app.state.bus, [KeysChanged(prefix=key.prefix)])
    except APIError as exc:
        await db_session.rollback()
        flash(request, "error", exc.message)
        return back(f"/keys?org={key.org_id}")
    return _created(request, created, "rotated")


# --- models and adapters --------------------------------------------------------------------


@get("/models")
async def models(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    org: FromQuery[str | None] = None,
) -> Template:
    admin = _admin(request)
    org_id = await _org_for_write(db_session, admin, org)
    catalogue = list(await ModelService(session=db_session).get_many(order_by=[(Model.name, False)]))
    adapters = await AdapterService(session=db_session).list_for_org(org_id)
    names = {m.id: m.name for m in catalogue}
    return page(
        request,
        "models.html",
        title="Models & adapters",
        current="models",
        models=catalogue,
        adapters=adapters,
        model_names=names,
        org_id=org_id,
        orgs=await org_names(db_session, admin),
        max_rank=request.app.state.settings.max_lora_rank,
    )


# Not behind Litestar's CSRF middleware, which would read the whole form (files and all)
# before anything else is checked: the token is checked here, before the first file, and
# Litestar's body limit gives way to the one `read_adapter_upload` derives from the model.
@post("/adapters", request_max_body_size=None, exclude_from_csrf=True)
async def upload_adapter(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Redirect:
    """The two PEFT files, checked against the base model and stored (as the admin API's
    upload); the page's script sends it with a progress bar, a plain form post works too."""
    admin = _admin(request)
    state = request.app.state
    org_id = admin.org_id

    async def before_files(form: Form) -> None:
        nonlocal org_id
        check_csrf(request, request.headers.get("x-csrftoken") or form.text("_csrf_token"))
        # Another organisation's (or a missing) one is a 404 page, as everywhere.
        org_id = await _org_for_write(db_session, admin, form.text("org"))

    adapters = AdapterService(session=db_session)
    try:
        upload = await read_adapter_upload(
            request, adapters, state.settings, state.storage, before_files=before_files
        )
    except APIError as exc:
        if exc.status == 404 or org_id is None:
            raise
        flash(request, "error", exc.message)
        return back(f"/models?org={org_id}")
    try:
        adapter = await _store_adapter(request, db_session, admin, org_id, upload)
    except APIError as exc:
        await db_session.rollback()
        flash(request, "error", exc.message)
        return back(f"/models?org={org_id}")
    finally:
        await upload.form.close()
    flash(request, "ok", f"Uploaded adapter {adapter.name} (rank {adapter.rank}); use it as the model name.")
    return back(f"/models?org={org_id}")


async def _store_adapter(
    request: Request[Any, Any, Any], db: AsyncSession, admin: Principal, org_id: str, upload: AdapterUpload
) -> Any:
    state = request.app.state
    adapter = await AdapterService(session=db).create_adapter(
        org_id=org_id,
        name=upload.name,
        model_ref=upload.model,
        config_raw=upload.config,
        weights=upload.weights.file,
        weights_size=upload.weights_size,
        storage=state.storage,
        cache_dir=state.settings.cache_dir,
        max_rank=state.settings.max_lora_rank,
        actor=admin,
    )
    # Committed here, not when the request ends: if that fails, the stored files go too.
    try:
        await db.commit()
    except BaseException:
        await asyncio.to_thread(remove_adapter_files, state.storage, adapter.storage_key or "")
        raise
    return adapter


@post("/adapters/{adapter_id:str}/delete")
async def delete_adapter(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], adapter_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    service = AdapterService(session=db_session)
    adapter = await service.visible(adapter_id, admin)

    async def act() -> str:
        prefix = await service.delete_adapter(adapter, admin)
        await db_session.commit()
        if prefix:
            await asyncio.to_thread(remove_adapter_files, request.app.state.storage, prefix)
        return f"Deleted adapter {adapter.name}."

    return await attempt(request, db_session, f"/models?org={adapter.org_id}", act)


# --- deployments ----------------------------------------------------------------------------


@get("/deployments")
async def deployments(request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]) -> Template:
    admin = _admin(request)
    deps = await DeploymentService(session=db_session).list_visible(admin)
    fleet, _ = _fleet_rows(request, deps, admin)
    catalogue = await ModelService(session=db_session).get_many(order_by=[(Model.name, False)])
    return page(
        request,
        "deployments.html",
        title="Deployments",
        current="deployments",
        fleet=fleet,
        models=[m for m in catalogue],
        model_names={m.id: m.name for m in catalogue},
        orgs=await org_names(db_session, admin),
    )


@post("/deployments")
async def create_deployment(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)
    created: list[str] = []

    async def act() -> str:
        body = {
            "name": fields.get("name", ""),
            "model": fields.get("model", ""),
            "type": "dedicated",
            "org_id": fields.get("org") or admin.org_id,
            "gpu_type": fields.get("gpu_type") or None,
            "min_replicas": _int(fields.get("min_replicas"), "min_replicas") or 0,
            "max_replicas": _int(fields.get("max_replicas"), "max_replicas") or 1,
        }
        dep = await DeploymentService(session=db_session).create_deployment(
            convert(body, DeploymentCreate), admin
        )
        created.append(dep.id)
        return f"Created dedicated deployment {dep.name}; use it as the model name."

    result = await attempt(request, db_session, "/deployments", act)
    return back(f"/deployments/{created[0]}") if created else result


async def _deployment_view(request: Request[Any, Any, Any], db: AsyncSession, dep_id: str) -> dict[str, Any]:
    admin = _admin(request)
    dep = await DeploymentService(session=db).visible(dep_id, admin)
    rows, workers = _fleet_rows(request, [dep], admin)
    model = await db.get(Model, dep.model_id)
    return {
        "dep": dep,
        "row": rows[0],
        "workers": workers,
        "model": model,
        "may_change": dep.org_id is not None or admin.is_platform_admin,
        "org_name": (await org_names(db, admin)).get(dep.org_id or "", ""),
    }


@get("/deployments/{dep_id:str}")
async def deployment(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], dep_id: FromPath[str]
) -> Template:
    view = await _deployment_view(request, db_session, dep_id)
    return page(request, "deployment.html", title=view["dep"].name, current="deployments", **view)


@get("/deployments/{dep_id:str}/workers")
async def deployment_workers(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], dep_id: FromPath[str]
) -> Template:
    """The live-workers table alone, which the page's script reloads every few seconds."""
    view = await _deployment_view(request, db_session, dep_id)
    return Template("_workers.html", context={"base": PREFIX, **view})


@post("/deployments/{dep_id:str}")
async def update_deployment(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], dep_id: FromPath[str]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)
    service = DeploymentService(session=db_session)
    dep = await service.visible(dep_id, admin)

    async def act() -> str:
        change: dict[str, Any] = {}
        for name in ("min_replicas", "max_replicas"):
            value = _int(fields.get(name), name)
            if value is not None:
                change[name] = value
        if fields.get("status") in ("active", "stopped"):
            change["status"] = fields["status"]
        await service.update_deployment(dep, convert(change, DeploymentUpdate), admin)
        return f"Updated {dep.name}: {dep.min_replicas} to {dep.max_replicas} replicas, {dep.status}."

    return await attempt(request, db_session, f"/deployments/{dep_id}", act)


# --- usage ----------------------------------------------------------------------------------


async def _usage_filter(
    db: AsyncSession, admin: Principal, org: str | None, key: str | None, model: str | None
) -> tuple[UsageFilter, Any]:
    org_id = await scope_org(db, admin, org)
    found = None
    if key:
        found = await ApiKeyService(session=db).visible(key, admin)
        if org_id is not None and found.org_id != org_id:
            raise APIError(404, f"No API key '{key}'.", code="not_found")
    return UsageFilter(org_id=org_id, key_id=found.id if found else None, model=model or None), found


@get("/usage")
async def usage(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    range: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Template:
    admin = _admin(request)
    start = request.query_params.get("from")  # a Python keyword, so not a parameter
    filt, _ = await _usage_filter(db_session, admin, org, key, model)
    win = window(range or ("7d" if not (start or to) else None), start, to)
    series = await usage_series(db_session, win, filt)
    key_choices = await ApiKeyService(session=db_session).list_for_org(filt.org_id) if filt.org_id else []
    deps = await DeploymentService(session=db_session).list_visible(admin)
    names = sorted({d.name for d in deps})
    if filt.org_id:
        names += sorted(a.name for a in await AdapterService(session=db_session).list_for_org(filt.org_id))
    params = {
        "org": org or "",
        "key": key or "",
        "model": model or "",
        "from": win.from_date,
        "to": win.to_date,
    }
    return page(
        request,
        "usage.html",
        title="Usage",
        current="usage",
        series=series,
        charts=[c for c in usage_charts(series, "usage") if not c["id"].endswith("errors")],
        win=win,
        filt=filt,
        orgs=await org_names(db_session, admin),
        key_choices=key_choices,
        model_names=names,
        params=params,
        csv_query="&".join(f"{k}={v}" for k, v in params.items() if v),
    )


@get("/usage.csv")
async def usage_export(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Stream:
    """Every ledger row of the filter, as the admin API's usage export writes them."""
    admin = _admin(request)
    start = request.query_params.get("from")
    filt, _ = await _usage_filter(db_session, admin, org, key, model)
    win = window("7d" if not (start or to) else None, start, to)
    sessionmaker = request.app.state.sessionmaker

    async def chunks() -> AsyncIterator[bytes]:
        # A session of its own: the request's closes when the handler returns, before the
        # first byte is sent.
        async with sessionmaker() as db:
            async for chunk in usage_csv(db, win, filt):
                yield chunk

    name = f"usage-{filt.org_id or 'all'}-{win.from_date}-{win.to_date}.csv"
    return Stream(
        chunks(),
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )


# --- invoices -------------------------------------------------------------------------------


@get("/invoices")
async def invoices(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    org: FromQuery[str | None] = None,
    month: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
) -> Template:
    admin = _admin(request)
    org_id = await scope_org(db_session, admin, org)
    found = await list_invoices(
        db_session, org_id=org_id, month=month or None, status=status or None, limit=200
    )
    return page(
        request,
        "invoices.html",
        title="Invoices",
        current="invoices",
        invoices=found,
        orgs=await org_names(db_session, admin),
        params={"org": org or "", "month": month or "", "status": status or ""},
    )


async def _invoice(db: AsyncSession, admin: Principal, invoice_id: str) -> Any:
    # Another organisation's invoice reads exactly like a missing one.
    return await get_invoice(db, invoice_id, org_id=None if admin.is_platform_admin else admin.org_id or "")


@get("/invoices/{invoice_id:str}")
async def invoice(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession], invoice_id: FromPath[str]
) -> Template:
    admin = _admin(request)
    found = await _invoice(db_session, admin, invoice_id)
    return page(
        request,
        "invoice.html",
        title=f"Invoice {found.id}",
        current="invoices",
        invoice=found,
        org_name=(await org_names(db_session, admin)).get(found.org_id, found.org_id),
    )


@get("/invoices/{invoice_id:str}/download/{fmt:str}")
async def invoice_download(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    invoice_id: FromPath[str],
    fmt: FromPath[str],
) -> Response[bytes]:
    found = await _invoice(db_session, _admin(request), invoice_id)
    if fmt not in ("csv", "json"):
        raise APIError(404, "Download as csv or json.")
    body = invoice_csv(found) if fmt == "csv" else invoice_json(found)
    media = "text/csv; charset=utf-8" if fmt == "csv" else "application/json"
    return Response(
        body,
        media_type=media,
        headers={"content-disposition": f'attachment; filename="invoice-{found.id}.{fmt}"'},
    )


# --- prices and plans -----------------------------------------------------------------------


@get("/prices")
async def prices(request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]) -> Template:
    book = PriceBook(db_session)
    catalogue = await ModelService(session=db_session).get_many(order_by=[(Model.name, False)])
    return page(
        request,
        "prices.html",
        title="Prices & plans",
        current="prices",
        model_prices=await book.model_prices(),
        current_prices={m.id: p.id for p, m in await book.model_prices(at=datetime.now(UTC))},
        gpu_prices=await book.gpu_prices(),
        plans=list(await PlanService(session=db_session).get_many(order_by=[(Plan.name, False)])),
        models=list(catalogue),
    )


@post("/prices/models")
async def add_model_price(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    async def act() -> str:
        _platform_only(admin, "set prices")
        input_price = _decimal(fields.get("input_per_mtok"), "input_per_mtok")
        output_price = _decimal(fields.get("output_per_mtok"), "output_per_mtok")
        if input_price is None or output_price is None:
            raise APIError(400, "Give the input and output prices.", param="input_per_mtok")
        price, model = await PriceBook(db_session).add_model_price(
            model_ref=fields.get("model", ""),
            input_per_mtok=input_price,
            output_per_mtok=output_price,
            cached_input_per_mtok=_decimal(fields.get("cached_input_per_mtok"), "cached_input_per_mtok"),
            currency=fields.get("currency") or "usd",
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return f"New price of {model.name} in effect from now."

    return await attempt(request, db_session, "/prices", act)


@post("/prices/gpus")
async def add_gpu_price(
    request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]
) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    async def act() -> str:
        _platform_only(admin, "set prices")
        per_hour = _decimal(fields.get("per_hour"), "per_hour")
        if per_hour is None:
            raise APIError(400, "Give the price per GPU-hour.", param="per_hour")
        price = await PriceBook(db_session).add_gpu_price(
            gpu_type=fields.get("gpu_type", ""), per_hour=per_hour, currency=fields.get("currency") or "usd"
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return f"New price of {price.gpu_type} in effect from now."

    return await attempt(request, db_session, "/prices", act)


@post("/plans")
async def create_plan(request: Request[Any, Any, Any], db_session: NamedDependency[AsyncSession]) -> Redirect:
    admin = _admin(request)
    fields = await form_fields(request)

    async def act() -> str:
        _platform_only(admin, "create plans")
        body: dict[str, Any] = {
            "name": fields.get("name", ""),
            "budget_mode": fields.get("budget_mode") or "soft",
        }
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            body[name] = _int(fields.get(name), name)
        budget = _decimal(fields.get("monthly_budget"), "monthly_budget")
        body["monthly_budget"] = None if budget is None else str(budget)
        plan = await PlanService(session=db_session).create_plan(convert(body, PlanCreate), admin)
        return f"Created plan {plan.name}."

    return await attempt(request, db_session, "/prices", act)


# --- the routes -----------------------------------------------------------------------------

PAGES = [
    overview,
    organizations,
    create_organization,
    organization,
    assign_plan,
    set_org_status,
    create_user,
    update_user,
    keys,
    create_key,
    revoke_key,
    rotate_key,
    models,
    upload_adapter,
    delete_adapter,
    deployments,
    create_deployment,
    deployment,
    deployment_workers,
    update_deployment,
    usage,
    usage_export,
    invoices,
    invoice,
    invoice_download,
    prices,
    add_model_price,
    add_gpu_price,
    create_plan,
]

# Everything but the login form needs a signed-in admin.
ROUTES = [login_form, login, logout, Router(path="/", route_handlers=PAGES, guards=[require_login])]
