"""Organisations and their users.

Methods take the acting `Principal` (control_plane.policy); callers without one (the CLI's
admin commands, the first start, Stripe's webhook) act as `SYSTEM`. Each change writes its
audit entry into the same session, and what gateways cache of it (an organisation's status or
plan, a disabled user's keys) is put in the session's outbox, announced once it commits.
A changed password or a disabled user also ends the user's dashboard sessions
(control_plane/orgs/sessions.py), whichever front door made the change.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.services import record_change, snapshot
from control_plane.catalog.deployments import hold_deployments
from control_plane.common import changes as changes_of
from control_plane.common import flush_unique, not_found
from control_plane.events import outbox
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey, Organization, User
from control_plane.orgs.schemas import UserUpdate
from control_plane.orgs.sessions import DashboardSessionService
from control_plane.paging import Page, PageQuery, contains, keyset_page
from control_plane.plans.models import Plan
from control_plane.policy import (
    ACTIVE,
    SUSPENDED,
    SYSTEM,
    Principal,
    is_suspended,
    may_grant,
    may_manage,
    org_scope,
    require_platform_admin,
)
from tokenmill import security
from tokenmill.errors import APIError

if TYPE_CHECKING:
    from control_plane.orgs.schemas import OrganizationUpdate


async def _plan_ref(session: AsyncSession, plan_id: str) -> Plan:
    plan = await session.get(Plan, plan_id)
    if plan is None:
        raise APIError(400, f"No plan '{plan_id}'.", param="plan_id")
    return plan


def _org_name(raw: str) -> str:
    name = raw.strip()
    if not name:
        raise APIError(400, "Organisation name must not be empty.", param="name")
    return name


class OrganizationService(SQLAlchemyAsyncRepositoryService[Organization]):
    class Repo(SQLAlchemyAsyncRepository[Organization]):
        model_type = Organization

    repository_type = Repo

    async def create_org(
        self, name: str, *, plan_id: str | None = None, actor: Principal = SYSTEM
    ) -> Organization:
        require_platform_admin(actor, "create organisations")
        name = _org_name(name)
        if await self.exists(name=name):
            raise APIError(409, f"An organisation named '{name}' already exists.", param="name")
        if plan_id is not None:
            await _plan_ref(self.repository.session, plan_id)
        org = await self.create(Organization(name=name, plan_id=plan_id))
        await record_change(
            self.repository.session, actor, "create", "organization", org.id, org_id=org.id, after=org
        )
        return org

    async def by_ref(self, ref: str) -> Organization:
        """Find an organisation by id or by name."""
        org = await self.get_one_or_none(or_(Organization.id == ref, Organization.name == ref))
        if org is None:
            raise APIError(404, f"No organisation '{ref}'.", code="not_found")
        return org

    async def visible(self, ref: str, actor: Principal) -> Organization:
        """By id or name, if `actor` may see it; others' are 404 exactly like missing ones."""
        org = await self.get_one_or_none(or_(Organization.id == ref, Organization.name == ref))
        if org is None or not actor.sees(org.id):
            raise not_found("organisation", ref)
        return org

    async def list_visible(self, actor: Principal) -> Sequence[Organization]:
        scope = org_scope(actor)
        if scope is None:
            return await self.get_many(order_by=[(Organization.created_at, False)])
        return await self.get_many(Organization.id == scope)

    async def page_visible(self, actor: Principal, query: PageQuery) -> Page[Organization]:
        """A page of the organisations `actor` may see, oldest first, searched by name (or
        id)."""
        stmt = select(Organization)
        if (scope := org_scope(actor)) is not None:
            stmt = stmt.where(Organization.id == scope)
        return await keyset_page(
            self.repository.session,
            stmt,
            query,
            by=[(Organization.created_at, False), (Organization.id, False)],
            search=lambda text: or_(
                contains(Organization.name, text), contains(Organization.id, text, lowercase=True)
            ),
        )

    async def scope(self, ref: str | None, actor: Principal) -> str | None:
        """The organisation a read (usage, invoices, exports) is confined to: the one named
        if `actor` may see it (404 otherwise, like a missing one), else the actor's own; None
        (every organisation) only for platform admins who name none."""
        if ref:
            return (await self.visible(ref, actor)).id
        return org_scope(actor)

    async def update_org(self, org: Organization, data: OrganizationUpdate, actor: Principal) -> Organization:
        """Rename (its own admins may), assign a plan or set how Stripe bills it (platform
        admins only). A new plan means new limits: gateways drop the organisation's keys."""
        changes = changes_of(data)
        for param in ("plan_id", "billing_mode"):
            if param in changes:
                require_platform_admin(actor, f"set {param}", param)
        session = self.repository.session
        before = snapshot(org)
        if "name" in changes:
            name = _org_name(changes["name"])
            if name != org.name and await self.exists(name=name):
                raise APIError(409, f"An organisation named '{name}' already exists.", param="name")
            org.name = name
        if "plan_id" in changes and changes["plan_id"] != org.plan_id:
            if changes["plan_id"] is not None:
                await _plan_ref(self.repository.session, changes["plan_id"])
            org.plan_id = changes["plan_id"]
            outbox(session).keys_changed(org_id=org.id)
        if "billing_mode" in changes:
            # Switching never bills a period twice: billing/stripe/ keeps meters and
            # mirrored invoices apart by period.
            org.billing_mode = changes["billing_mode"]
        await flush_unique(session, f"An organisation named '{org.name}' already exists.", "name")
        await record_change(
            session, actor, "update", "organization", org.id, org_id=org.id, before=before, after=org
        )
        return org

    async def suspend(self, ref: str, actor: Principal) -> bool:
        """Refuse the organisation's keys, admins and dashboard users (but for reading its
        invoices and usage) and scale its deployments to zero. False if it already was."""
        return await self._set_status(ref, SUSPENDED, actor)

    async def resume(self, ref: str, actor: Principal) -> bool:
        """Lift a suspension: keys work again and the deployments it held come back as they
        were. False if it was not suspended."""
        return await self._set_status(ref, ACTIVE, actor)

    async def _set_status(self, ref: str, status: str, actor: Principal) -> bool:
        # Platform admins only, whichever organisation: checked before it is looked up.
        require_platform_admin(actor, "suspend or resume organisations")
        org = await self.visible(ref, actor)
        suspend = status == SUSPENDED
        if is_suspended(org) == suspend:
            return False
        session = self.repository.session
        before = snapshot(org)
        org.status = status
        await session.flush()
        await hold_deployments(session, org.id, hold=suspend, actor=actor)
        action = "suspend" if suspend else "resume"
        await record_change(
            session, actor, action, "organization", org.id, org_id=org.id, before=before, after=org
        )
        outbox(session).keys_changed(org_id=org.id)
        return True


# --- users ---------------------------------------------------------------------------------

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def _email(raw: str) -> str:
    # Addresses compare case-insensitively in practice; one account per address.
    email = raw.strip().lower()
    if not _EMAIL.match(email):
        raise APIError(400, f"'{raw}' is not an email address.", param="email")
    return email


class UserService(SQLAlchemyAsyncRepositoryService[User]):
    class Repo(SQLAlchemyAsyncRepository[User]):
        model_type = User

    repository_type = Repo

    async def create_user(
        self, *, org_id: str, email: str, password: str, role: str = "member", actor: Principal = SYSTEM
    ) -> User:
        email = _email(email)
        may_grant(actor, role, "create platform admins")
        if await self.exists(email=email):
            raise APIError(409, f"A user with email '{email}' already exists.", param="email")
        # argon2 is deliberately slow (tens of ms): keep it off the event loop.
        hashed = await asyncio.to_thread(security.hash_password, password)
        user = User(org_id=org_id, email=email, password_hash=hashed, role=role)
        self.repository.session.add(user)
        await flush_unique(self.repository.session, f"A user with email '{email}' already exists.", "email")
        await record_change(
            self.repository.session, actor, "create", "user", user.id, org_id=org_id, after=user
        )
        return user

    async def page_for_org(self, org_id: str, query: PageQuery) -> Page[User]:
        """A page of the organisation's users, oldest first, searched by email. `org_id` is one
        the caller may see."""
        return await keyset_page(
            self.repository.session,
            select(User).where(User.org_id == org_id),
            query,
            by=[(User.created_at, False), (User.id, False)],
            search=lambda text: contains(User.email, text),
        )

    async def emails(self, org_id: str, user_ids: Iterable[str]) -> dict[str, str]:
        """The emails of those of `user_ids` in the organisation, by id."""
        ids = set(user_ids)
        if not ids:
            return {}
        rows = await self.repository.session.execute(
            select(User.id, User.email).where(User.org_id == org_id, User.id.in_(ids))
        )
        return {user_id: email for user_id, email in rows}

    async def visible(self, user_id: str, actor: Principal) -> User:
        user = await self.get_one_or_none(User.id == user_id)
        if user is None or not actor.sees(user.org_id):
            raise not_found("user", user_id)
        return user

    async def update_user(self, user: User, data: UserUpdate, actor: Principal) -> list[str]:
        """Change role, password or disabled; disabling revokes the user's API keys. A new
        password or disabling ends all of the user's dashboard sessions. Returns the prefixes
        of the keys revoked."""
        changes = changes_of(data)
        session = self.repository.session
        may_manage(actor, user.role, "change platform admins")
        if "role" in changes:
            may_grant(actor, changes["role"], "make platform admins")
        if user.id == actor.user_id and changes.get("disabled"):
            raise APIError(400, "You cannot disable yourself.", param="disabled")
        before = snapshot(user)
        if "role" in changes:
            user.role = changes["role"]
        if "password" in changes:
            user.password_hash = await asyncio.to_thread(security.hash_password, changes["password"])
        revoked: list[str] = []
        if "disabled" in changes:
            user.disabled = changes["disabled"]
            if user.disabled:
                keys = ApiKeyService(session=session)
                for key in await keys.get_many(ApiKey.user_id == user.id, ApiKey.revoked_at.is_(None)):
                    await keys.revoke(key.id, actor=actor)
                    revoked.append(key.prefix)
        if "password" in changes or changes.get("disabled"):
            # Whoever held a session (a captured cookie included) must now know the new
            # password, or wait for the account to be enabled again, and sign in afresh.
            await DashboardSessionService(session).end_all(user.id)
        await session.flush()
        after = snapshot(user)
        # The hash itself never reaches the log; that it changed does.
        if "password" in changes:
            after["password_changed"] = True
        await record_change(
            session, actor, "update", "user", user.id, org_id=user.org_id, before=before, after=after
        )
        return revoked

    async def change_own_password(self, actor: Principal, current: str, new: str) -> User:
        """A signed-in user (the dashboard's account page) changes their own password: only
        with the current one, so a session left open is not enough to take the account over.
        Like every password change, it ends all of the user's dashboard sessions."""
        user = await self.get_one_or_none(User.id == actor.user_id) if actor.user_id else None
        if user is None or user.disabled:
            raise APIError(400, "Only a signed-in user changes their own password.")
        ok = await asyncio.to_thread(security.verify_password, current, user.password_hash or _dummy_hash())
        if not ok or user.password_hash is None:
            raise APIError(400, "The current password is not correct.", param="current_password")
        if not 8 <= len(new) <= 1024:
            raise APIError(400, "The new password needs 8 to 1024 characters.", param="password")
        if new == current:
            raise APIError(400, "The new password is the same as the current one.", param="password")
        await self.update_user(user, UserUpdate(password=new), actor)
        return user

    async def authenticate(self, email: str, password: str) -> User | None:
        """The enabled user with this email and password, else None (the dashboard's sign-in).
        Verifies against a dummy hash when the email is unknown, so the answer takes as long
        either way."""
        user = await self.get_one_or_none(User.email == email.strip().lower())
        stored = user.password_hash if user is not None and user.password_hash else _dummy_hash()
        ok = await asyncio.to_thread(security.verify_password, password, stored)
        if user is None or not ok or user.disabled:
            return None
        return user


@functools.cache
def _dummy_hash() -> str:
    return security.hash_password("not a real password")
