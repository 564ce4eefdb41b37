"""The signed-in admin's own account: changing their password (HTTP only: the rule is
UserService.change_own_password's).

A password change ends every dashboard session of the user, this one included (the service
does that, whichever front door changes a password). The browser that changed it stays
signed in with a session started afresh, so the one who knows the new password is not sent
back to the login page, while every other browser (and a captured cookie) is signed out.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.response import Redirect, Template

from control_plane.unit import UnitOfWork
from dashboard.auth import check_login_rate, session_cookie, session_lifetime
from dashboard.web import admin_of, attempt, page
from tokenmill.clients import client_address, trusted_networks
from tokenmill.errors import APIError


@get("/account")
async def account(request: Request[Any, Any, Any]) -> Template:
    return page(request, "account.html", title="Your account", current="account")


@post("/account/password")
async def change_password(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    state = request.app.state
    # Passwords as typed: unlike other fields, surrounding spaces are part of them.
    form = await request.form()
    current, new, again = (str(form.get(name) or "") for name in ("current_password", "password", "again"))
    started: list[str] = []

    async def act() -> str:
        if new != again:
            raise APIError(400, "The new password and its repetition differ.", param="again")
        # Guessing the current password from an open session is as slow as at the login.
        address = client_address(request.scope, trusted_networks(state.settings.trusted_proxies))
        wait = await check_login_rate(
            state.limiter, state.dashboard_settings, address, request.state.user.email
        )
        if wait:
            raise APIError(429, f"Too many attempts; try again in {int(wait) + 1} seconds.")
        user = await uow.users.change_own_password(admin, current, new)
        started.append(await uow.dashboard_sessions.start(user, session_lifetime(state)))
        return "Password changed; your other dashboard sessions are signed out."

    redirect = await attempt(request, uow, "/account", act)
    if started:
        redirect.set_cookie(session_cookie(state, started[0]))
    return redirect
