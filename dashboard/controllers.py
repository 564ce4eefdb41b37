"""The dashboard's sign-in, overview and routes; the other pages are in the `*_pages.py`
modules imported below (HTTP only: reads are in services.py, writes go through the control
plane's and billing's services, which check roles and write the audit log).

Forms post back and redirect (303) with a one-line message in a cookie, so reloading a
page never repeats a change; a new API key's secret travels the same way, to the one page
that shows it once (org_pages.key_created). Each request is one unit of work
(control_plane/unit.py), as on the admin API: the services hold every rule
(control_plane/policy.py), and what gateways cache is announced once the change is committed.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from control_plane.policy import (
    WHILE_SUSPENDED,
    is_admin_role,
    org_scope,
)
from control_plane.unit import UnitOfWork
from dashboard import PREFIX
from dashboard.account_pages import account, change_password
from dashboard.audit_pages import audit_log
from dashboard.auth import (
    check_login_rate,
    require_login,
    session_cookie,
    session_lifetime,
    session_token,
    signed_in_user,
)
from dashboard.batch_pages import batch_download, batches, cancel_batch
from dashboard.billing_pages import (
    add_gpu_price,
    add_model_price,
    create_plan,
    finalize_draft,
    generate_invoices,
    invoice,
    invoice_download,
    invoices,
    prices,
    run_rollups,
)
from dashboard.catalog_pages import (
    create_deployment,
    delete_adapter,
    deployment,
    deployment_workers,
    deployments,
    fleet_rows,
    models,
    update_deployment,
    upload_adapter,
)
from dashboard.limits_pages import limits
from dashboard.org_pages import (
    assign_plan,
    create_key,
    create_organization,
    create_user,
    key_created,
    keys,
    organization,
    organizations,
    revoke_key,
    rotate_key,
    set_org_status,
    update_user,
)
from dashboard.services import (
    PRESETS,
    UsageFilter,
    org_statuses,
    usage_series,
    window,
)
from dashboard.usage_pages import refusals_export, usage, usage_charts, usage_export
from dashboard.web import (
    admin_of,
    form_fields,
    page,
)
from tokenmill.clients import client_address, trusted_networks

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
    if await signed_in_user(request) is not None:
        return Redirect(_safe_next(next), status_code=303)
    return _login_page(next_=_safe_next(next))


@post("/login", status_code=200)
async def login(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Response[Any]:
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
    user = await uow.users.authenticate(email, str(password))
    if user is None:
        return _login_page("Incorrect email or password.", 401, email, target)
    if not is_admin_role(user.role):
        return _login_page(
            "The dashboard is for platform and organisation admins; members use API keys.", 403, email
        )
    sessions = uow.dashboard_sessions
    # Whatever session this browser held ends: a new sign-in always gets a new token, so
    # a token planted in the browser beforehand never becomes a signed-in one.
    await sessions.end(session_token(request))
    token = await sessions.start(user, session_lifetime(state))
    request.scope["session"] = {}  # no message of a previous session shows
    return Redirect(target, status_code=303, cookies=[session_cookie(state, token)])


@post("/logout", guards=[require_login], status_code=200, opt=WHILE_SUSPENDED)
async def logout(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    # The row goes, so the token is dead everywhere, not only in this browser.
    await uow.dashboard_sessions.end(request.state.session_token)
    request.scope["session"] = {}
    return Redirect(PREFIX + "/login", status_code=303, cookies=[session_cookie(request.app.state, None)])


# --- overview -------------------------------------------------------------------------------


@get("/")
async def overview(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    range: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await uow.orgs.scope(None, admin)
    win = window(range)
    series = await usage_series(uow.session, win, UsageFilter(org_id=org_id))
    deployments = await uow.deployments.list_visible(admin)
    fleet, _ = fleet_rows(request, deployments, admin)
    scope = org_scope(admin)
    statuses = await org_statuses(uow.session, None if scope is None else [scope])
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


@get("/{rest:path}")
async def unknown_page(rest: FromPath[str]) -> None:
    """Any other path: behind the sign-in like every page, so its 404 page has the navigation
    (the router's own 404 comes before any guard)."""
    raise NotFoundException()


# --- the routes -----------------------------------------------------------------------------

PAGES = [
    overview,
    account,
    change_password,
    organizations,
    create_organization,
    organization,
    assign_plan,
    set_org_status,
    create_user,
    update_user,
    keys,
    create_key,
    key_created,
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
    batches,
    batch_download,
    cancel_batch,
    usage,
    usage_export,
    refusals_export,
    limits,
    invoices,
    invoice,
    invoice_download,
    run_rollups,
    generate_invoices,
    finalize_draft,
    prices,
    add_model_price,
    add_gpu_price,
    create_plan,
    audit_log,
    unknown_page,
]

# Everything but the login form needs a signed-in admin.
ROUTES = [login_form, login, logout, Router(path="/", route_handlers=PAGES, guards=[require_login])]
