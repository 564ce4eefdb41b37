"""Who is signed in to the dashboard: the session cookie, the login rate limit, the guard.

A session is an encrypted cookie (AES-GCM, Litestar's client-side backend) holding the
user's id and the time they signed in, under a key derived from TOKENMILL_SECRET_KEY, so
every replica of the control plane reads the same sessions and a restart signs nobody out.
Each request loads the user again: a user disabled, removed or demoted to member is out at
once, and a changed role applies to the next page. The role rules are the admin API's
(`control_plane.services.Principal`): platform admins see everything, organisation admins
their own organisation; members use API keys and have no dashboard.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from control_plane.controllers import ADMIN_ROLES
from control_plane.models import User
from control_plane.services import Principal
from tokenmill.limits import Limit, RateLimiter

# Login attempts are counted over this many seconds, per address and email and per address.
LOGIN_PERIOD = 300.0


class DashboardSettings(BaseSettings):
    """The dashboard's own settings (environment `TOKENMILL_DASHBOARD_*`)."""

    model_config = SettingsConfigDict(env_prefix="TOKENMILL_DASHBOARD_", extra="ignore")

    secure_cookies: bool = Field(
        default=False,
        description="Mark the session and CSRF cookies `Secure` (set it when the dashboard is "
        "served over https).",
    )
    session_hours: float = Field(default=8.0, gt=0, description="How long a sign-in lasts.")
    login_attempts: int = Field(
        default=5, ge=1, description="Sign-in attempts per client address and email in 5 minutes."
    )
    login_attempts_per_address: int = Field(
        default=30, ge=1, description="Sign-in attempts per client address (any email) in 5 minutes."
    )


def derive(secret_key: str | None, purpose: str) -> bytes:
    """A 32-byte key for one purpose from the server's secret key. Without one (a test app),
    a random key: sessions then last as long as the process."""
    base = secret_key.encode() if secret_key else secrets.token_bytes(32)
    return hmac.new(base, f"tokenmill dashboard {purpose}".encode(), hashlib.sha256).digest()


class LoginRequired(Exception):
    """No valid session: the exception handler sends the browser to the login page."""


class NoDashboard(Exception):
    """Signed in, but the role has no dashboard (members)."""


def login_limits(settings: DashboardSettings, address: str, email: str) -> list[Limit]:
    """Both limits of one attempt: guessing one account's password is slow, and so is trying
    many accounts from one address."""
    email_key = hashlib.sha256(email.strip().lower().encode()).hexdigest()[:32]  # no address in Redis keys
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
    ]


async def check_login_rate(
    limiter: RateLimiter, settings: DashboardSettings, address: str, email: str
) -> float:
    """0 if this attempt may go ahead (and counts it), else the seconds to wait."""
    decisions = await limiter.acquire_many(login_limits(settings, address, email))
    if all(d.allowed for d in decisions):
        return 0.0
    return max(d.retry_after for d in decisions if not d.allowed)


def start_session(connection: ASGIConnection[Any, Any, Any, Any], user: User) -> None:
    # A fresh dict: nothing of a previous session (or of an attacker's planted one) survives.
    connection.scope["session"] = {"uid": user.id, "at": time.time()}


async def require_login(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of every page but the login: the signed-in admin, as `connection.state.admin`
    (a `Principal`) and `connection.state.user`."""
    session = connection.scope.get("session") or {}
    uid, at = session.get("uid"), session.get("at")
    state = connection.app.state
    max_age = state.dashboard_settings.session_hours * 3600
    if not isinstance(uid, str) or not isinstance(at, int | float) or time.time() - at > max_age:
        raise LoginRequired()
    async with state.sessionmaker() as db:
        user = await db.get(User, uid)
    if user is None or user.disabled:
        connection.scope["session"] = {}
        raise LoginRequired()
    if user.role not in ADMIN_ROLES:
        raise NoDashboard()
    connection.state.user = user
    connection.state.admin = Principal(role=user.role, org_id=user.org_id, user_id=user.id)
