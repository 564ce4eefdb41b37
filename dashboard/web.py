"""Page plumbing every dashboard page shares: the layout's context, one-line messages for the
next page, form fields, and running a change as the request's unit of work."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from litestar import Request
from litestar.response import Redirect, Template

from control_plane.policy import Principal
from control_plane.unit import UnitOfWork
from dashboard import PREFIX
from tokenmill.errors import APIError

NAV = (
    ("overview", "/", "Overview"),
    ("orgs", "/orgs", "Organisations"),
    ("keys", "/keys", "API keys"),
    ("models", "/models", "Models & adapters"),
    ("deployments", "/deployments", "Deployments"),
    ("batches", "/batches", "Batches"),
    ("usage", "/usage", "Usage"),
    ("limits", "/limits", "Limits"),
    ("invoices", "/invoices", "Invoices"),
    ("prices", "/prices", "Prices & plans"),
    ("audit", "/audit", "Audit log"),
)


def admin_of(request: Request[Any, Any, Any]) -> Principal:
    return request.state.admin


def nav_of(admin: Principal, current: str) -> list[dict[str, Any]]:
    items = []
    for key, path, label in NAV:
        if key == "orgs" and not admin.is_platform_admin:
            # An organisation admin has one organisation: link straight to it.
            path, label = f"/orgs/{admin.org_id}", "Organisation"
        items.append({"path": path, "label": label, "current": key == current})
    return items


def flash(request: Request[Any, Any, Any], kind: str, text: str) -> None:
    """A message for the next page (kind `ok` or `error`), kept in an encrypted cookie."""
    request.session.setdefault("flash", []).append([kind, text])


def layout(request: Request[Any, Any, Any], title: str, current: str = "") -> dict[str, Any]:
    """What base.html needs: the navigation and who is signed in, when known (an error page
    met before the sign-in was checked has neither, and says so with a sign-in link)."""
    user = request.state.get("user")
    admin: Principal | None = request.state.get("admin")
    if admin is None and user is not None:
        # Signed in, but turned away before the page (a suspended organisation's admin):
        # the navigation still leads to what is open to them.
        admin = Principal(role=user.role, org_id=user.org_id, user_id=user.id)
    context: dict[str, Any] = {"base": PREFIX, "title": title, "admin": admin, "user": user}
    if admin is not None:
        context |= {"role_label": admin.role.replace("_", " "), "nav": nav_of(admin, current)}
    return context


def page(
    request: Request[Any, Any, Any], template: str, *, title: str, current: str, **context: Any
) -> Template:
    messages = request.session.pop("flash", [])
    return Template(template, context=layout(request, title, current) | {"flashes": messages, **context})


def back(path: str) -> Redirect:
    return Redirect(PREFIX + path, status_code=303)


async def form_fields(request: Request[Any, Any, Any]) -> dict[str, str]:
    data = await request.form()
    return {k: v.strip() for k, v in data.items() if isinstance(v, str)}


async def attempt(
    request: Request[Any, Any, Any], uow: UnitOfWork, to: str, action: Callable[[], Awaitable[str]]
) -> Redirect:
    """Run a change; either way back to `to`, with what happened as the page's message."""
    try:
        message = await action()
    except APIError as exc:
        await uow.rollback()  # nothing half-done is committed when the request ends
        flash(request, "error", exc.message)
        return back(to)
    flash(request, "ok", message)
    return back(to)


def form_int(value: str | None, param: str) -> int | None:
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"{param} must be a whole number.", param=param) from None


def form_decimal(value: str | None, param: str) -> Decimal | None:
    if not value:
        return None
    try:
        return Decimal(value)
    except InvalidOperation:
        raise APIError(400, f"{param} must be a number.", param=param) from None


async def org_for_write(uow: UnitOfWork, admin: Principal, ref: str | None) -> str:
    """The organisation a form acts on: the one named if visible, else the admin's own."""
    org_id = await uow.orgs.scope(ref or admin.org_id, admin)
    if org_id is None:
        raise APIError(400, "Choose an organisation.", param="org")
    return org_id
