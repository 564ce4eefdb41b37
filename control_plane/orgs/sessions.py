"""Dashboard sign-ins, kept in the database so that they can be ended.

The browser's cookie holds only a random token; the table holds its SHA-256 (the token has
256 bits of entropy, so an unkeyed hash cannot be reversed or guessed, and a copy of the
table signs nobody in). Every replica reads the same rows, so signing out, a password change
or disabling the user (UserService.update_user) ends a session everywhere at once, not just
in the browser that asked.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.orgs.models import DashboardSession, User
from tokenmill.db import utcnow

TOKEN_BYTES = 32
# token_urlsafe(32) is 43 characters: anything much longer is not ours, and is not hashed.
MAX_TOKEN_CHARS = 128


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _usable(token: str | None) -> bool:
    return bool(token) and len(token or "") <= MAX_TOKEN_CHARS


class DashboardSessionService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def start(self, user: User, lifetime: timedelta) -> str:
        """A new session for `user`, lasting `lifetime`; returns the token for the cookie (the
        only time it exists outside the browser)."""
        # Sign-ins are rare, so they carry the clean-up: the table stays at about the number
        # of live sessions without a periodic job.
        await self.purge_expired()
        token = secrets.token_urlsafe(TOKEN_BYTES)
        now = utcnow()
        self.session.add(
            DashboardSession(id=token_hash(token), user_id=user.id, created_at=now, expires_at=now + lifetime)
        )
        await self.session.flush()
        return token

    async def user_of(self, token: str | None) -> User | None:
        """The user signed in with `token`, if its session was neither ended nor has expired.
        Whether that user may still use the dashboard (disabled, role) is the caller's check."""
        if not _usable(token):
            return None
        stmt = (
            select(User)
            .join(DashboardSession, DashboardSession.user_id == User.id)
            .where(DashboardSession.id == token_hash(token or ""), DashboardSession.expires_at > utcnow())
        )
        return await self.session.scalar(stmt)

    async def end(self, token: str | None) -> None:
        """Sign out one session (a token that matches none is no error)."""
        if _usable(token):
            await self.session.execute(
                delete(DashboardSession).where(DashboardSession.id == token_hash(token or ""))
            )

    async def end_all(self, user_id: str) -> None:
        """Sign a user out everywhere."""
        await self.session.execute(delete(DashboardSession).where(DashboardSession.user_id == user_id))

    async def purge_expired(self) -> None:
        await self.session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= utcnow()))
