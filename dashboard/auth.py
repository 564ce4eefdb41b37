"""Who is signed in to the dashboard: the session cookie, the login rate limit, the guard.

A session is a row on the server (control_plane/orgs/sessions.py); the browser's cookie holds
only its random token (HttpOnly, SameSite=Lax, Secure when the public URL is https), which
names nobody and is worthless once the row is gone. So signing out, a password change and
disabling the user end a session on every replica at once, a captured cookie included, and
a restart signs nobody out. Each request loads the user again: a user disabled, removed or
demoted to member is out at once, and a changed role applies to the next page. The role
rules are the admin API's (`control_plane.policy`): platform admins see everything,
organisation admins their own organisation; members use API keys and have no dashboard; a
suspended organisation's admins only read its invoices and usage.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie, State
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler
from litestar.middleware.csrf import CSRF_SECRET_LENGTH, generate_csrf_hash
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from control_plane.orgs.models import Organization, User
from control_plane.orgs.sessions import DashboardSessionService
from control_plane.policy import OPEN_WHILE_SUSPENDED, admit, is_admin_role
from control_plane.unit import UnitOfWork
from dashboard import PREFIX
from tokenmill.clients import throttle_key
from tokenmill.limits import Limit, RateLimiter

SESSION_COOKIE = "tm_session"

# Login attempts are counted over this many seconds: per address and email, per address,
# and per email (whatever the address).
LOGIN_PERIOD = 300.0


class DashboardSettings(BaseSettings):
    """The dashboard's own settings (environment `TOKENMILL_DASHBOARD_*`)."""

    model_config = SettingsConfigDict(env_prefix="TOKENMILL_DASHBOARD_", extra="ignore")

    session_hours: float = Field(default=8.0, gt=0, description="How long a sign-in lasts.")
    login_attempts: int = Field(
        default=5, ge=1, description="Sign-in attempts per client address and email in 5 minutes."
    )
    login_attempts_per_address: int = Field(
        default=30, ge=1, description="Sign-in attempts per client address (any email) in 5 minutes."
    )
    login_attempts_per_account: int = Field(
        default=20,
        ge=1,
        description="Sign-in attempts per email (from any address) in 5 minutes, so guessing one "
        "account's password from many addresses is as slow as from one.",
    )


def derive(secret_key: str | None, purpose: str) -> bytes:
    """A 32-byte key for one purpose from the server's secret key. Without one (a test app),
    a random key: CSRF tokens and messages then last as long as the process."""
    base = secret_key.encode() if secret_key else secrets.token_bytes(32)
    return hmac.new(base, f"tokenmill dashboard {purpose}".encode(), hashlib.sha256).digest()


class LoginRequired(Exception):
    """No valid session: the exception handler sends the browser to the login page."""


class NoDashboard(Exception):
    """Signed in, but the role has no dashboard (members)."""


def login_limits(settings: DashboardSettings, address: str, email: str) -> list[Limit]:
    """The three limits of one attempt: guessing one account's password is slow from one
    address and from many, and so is trying many accounts from one address. (The price of
    the per-account one: someone flooding an account's sign-in delays its owner too.)"""
    email_key = hashlib.sha256(email.strip().lower().encode()).hexdigest()[:32]  # no address in Redis keys
    # Per IPv6 /64, not per address: one host commonly holds a whole /64.
    address = throttle_key(address)
    return [
        Limit(
            f"dash-login:{address}:{email_key}",
            rate=settings.login_attempts,
            period=LOGIN_PERIOD,
            burst=settings.login_attempts,
        ),
        Limit(
            f"dash-login:{address}",
            rate=settings.login_attempts_per_address,
            period=LOGIN_PERIOD,
            burst=settings.login_attempts_per_address,
        ),
        Limit(
            f"dash-login-account:{email_key}",
            rate=settings.login_attempts_per_account,
            period=LOGIN_PERIOD,
            burst=settings.login_attempts_per_account,
        ),
    ]


async def check_login_rate(
    limiter: RateLimiter, settings: DashboardSettings, address: str, email: str
) -> float:
    """0 if this attempt may go ahead (and counts it), else the seconds to wait."""
    decisions = await limiter.acquire_many(login_limits(settings, address, email))
    if all(d.allowed for d in decisions):
        return 0.0
    return max(d.retry_after for d in decisions if not d.allowed)


def check_csrf(request: Request[Any, Any, Any], token: str | None) -> None:
    """What Litestar's CSRF middleware checks, for the one form it does not see (the adapter
    upload, whose token must be checked before its files are read): the token sent matches
    the cookie, and both carry our HMAC. 403 otherwise, as the middleware answers."""
    config = request.app.csrf_config
    cookie = request.cookies.get(config.cookie_name) if config else None

    def secret_of(value: str | None) -> str | None:
        if config is None or not value or len(value) <= CSRF_SECRET_LENGTH:
            return None
        secret, digest = value[:CSRF_SECRET_LENGTH], value[CSRF_SECRET_LENGTH:]
        return secret if hmac.compare_digest(digest, generate_csrf_hash(secret, config.secret)) else None

    sent, expected = secret_of(token), secret_of(cookie)
    if sent is None or expected is None or not hmac.compare_digest(sent, expected):
        raise PermissionDeniedException("CSRF token verification failed")


def session_lifetime(state: State) -> timedelta:
    return timedelta(hours=state.dashboard_settings.session_hours)


def session_cookie(state: State, token: str | None) -> Cookie:
    """The cookie carrying a new session's `token`, or (None) the one clearing it."""
    return Cookie(
        key=SESSION_COOKIE,
        value=token or "",
        path=PREFIX,
        max_age=int(session_lifetime(state).total_seconds()) if token else 0,
        expires=None if token else 0,
        httponly=True,
        secure=state.secure_cookies,
        samesite="lax",
    )


def session_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    return connection.cookies.get(SESSION_COOKIE) or None


async def signed_in_user(connection: ASGIConnection[Any, Any, Any, Any]) -> User | None:
    """The user of the request's session, if it is live (enabled or not, whatever the role)."""
    token = session_token(connection)
    if token is None:
        return None
    async with connection.app.state.sessionmaker() as db:
        return await DashboardSessionService(db).user_of(token)


async def require_login(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard of every page but the login: the signed-in admin, as `connection.state.admin`
    (a `Principal`), `connection.state.user`, and the session's token as
    `connection.state.session_token`. A suspended organisation's admins see only the pages
    open while it is suspended (403 `organization_suspended` elsewhere)."""
    token = session_token(connection)
    state = connection.app.state
    if token is None:
        raise LoginRequired()
    async with state.sessionmaker() as db:
        user = await DashboardSessionService(db).user_of(token)
        org = await db.get(Organization, user.org_id) if user is not None and user.org_id else None
    # Disabling ends the sessions too; this stands guard over anything that would not.
    if user is None or user.disabled:
        raise LoginRequired()
    if not is_admin_role(user.role):
        # Signed out, as before the demotion was known: being made an admin again later
        # does not bring this session back.
        async with UnitOfWork.open(state.sessionmaker) as unit:
            await unit.dashboard_sessions.end(token)
        raise NoDashboard()
    open_while_suspended = bool(handler.opt.get(OPEN_WHILE_SUSPENDED))
    connection.state.user = user  # before `admit`, so the page refusing them still has the nav
    connection.state.admin = admit(
        user.role, user.org_id, org, while_suspended=open_while_suspended, user_id=user.id
    )
    connection.state.session_token = token
