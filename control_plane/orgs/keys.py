"""API keys: created, listed, changed, rotated and revoked by admins; checked by the gateway
and the admin API's guard.

Only a prefix (for lookup) and a keyed hash are stored. A change gateways cache (revoked,
rotated, new scopes or limits) is put in the session's outbox and announced once committed,
so a revoked key stops working everywhere within a second.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.services import record_change, snapshot
from control_plane.common import LIMITS, check_limits, not_found
from control_plane.common import changes as changes_of
from control_plane.events import outbox
from control_plane.orgs.models import ApiKey, Organization, User
from control_plane.paging import Page, PageQuery, any_contains, keyset_page
from control_plane.plans.models import Plan
from control_plane.policy import SYSTEM, Principal, may_grant, may_manage
from tokenmill import security
from tokenmill.db import utcnow
from tokenmill.errors import APIError

if TYPE_CHECKING:
    from control_plane.orgs.schemas import ApiKeyUpdate


@dataclass(slots=True)
class CreatedKey:
    key: ApiKey
    secret: str


def _check_scopes(scopes: list[str] | None) -> None:
    if scopes is not None and len(set(scopes)) != len(scopes):
        raise APIError(400, "scopes lists a model twice.", param="scopes")


def _check_expiry(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= utcnow():
        raise APIError(400, "expires_at must be in the future.", param="expires_at")


class ApiKeyService(SQLAlchemyAsyncRepositoryService[ApiKey]):
    class Repo(SQLAlchemyAsyncRepository[ApiKey]):
        model_type = ApiKey

    repository_type = Repo

    async def create_key(
        self,
        *,
        org_id: str,
        secret_key: str,
        name: str = "",
        role: str = "member",
        scopes: list[str] | None = None,
        expires_at: datetime | None = None,
        user_id: str | None = None,
        limits: dict[str, int | None] | None = None,
        actor: Principal = SYSTEM,
    ) -> CreatedKey:
        may_grant(actor, role, "create platform-admin keys")
        _check_expiry(expires_at)
        _check_scopes(scopes)
        limits = dict(limits or {})
        check_limits(limits)
        if user_id is not None:
            user = await self.repository.session.get(User, user_id)
            if user is None or user.org_id != org_id:
                raise APIError(400, f"No user '{user_id}' in this organisation.", param="user_id")
            if user.disabled:
                raise APIError(400, f"User '{user_id}' is disabled.", param="user_id")
        new = security.generate_key(secret_key)
        key = ApiKey(
            org_id=org_id,
            user_id=user_id,
            name=name,
            prefix=new.prefix,
            hash=new.hash,
            role=role,
            scopes=scopes,
            expires_at=expires_at,
            **limits,
        )
        key = await self.create(key)
        await self._audit(actor, "create", key, None, key)
        return CreatedKey(key, new.secret)

    async def _audit(
        self,
        actor: Principal,
        action: str,
        key: ApiKey,
        before: dict[str, Any] | None,
        after: ApiKey | dict[str, Any],
    ) -> None:
        session = self.repository.session
        await record_change(
            session, actor, action, "api_key", key.id, org_id=key.org_id, before=before, after=after
        )

    async def list_for_org(self, org_id: str) -> list[ApiKey]:
        return list(await self.get_many(ApiKey.org_id == org_id, order_by=[(ApiKey.created_at, False)]))

    async def page_for_org(self, org_id: str, query: PageQuery) -> Page[ApiKey]:
        """A page of the organisation's keys, oldest first (`order="desc"`: newest first),
        searched by name and prefix. `org_id` is one the caller may see."""
        return await keyset_page(
            self.repository.session,
            select(ApiKey).where(ApiKey.org_id == org_id),
            query,
            by=[(ApiKey.created_at, False), (ApiKey.id, False)],
            search=lambda text: any_contains(text, ApiKey.name, ApiKey.prefix),
        )

    async def visible(self, ref: str, actor: Principal) -> ApiKey:
        """By id or prefix, if `actor` may see it."""
        key = await self.get_one_or_none(or_(ApiKey.id == ref, ApiKey.prefix == ref))
        if key is None or not actor.sees(key.org_id):
            raise not_found("API key", ref)
        return key

    async def revoke(self, ref: str, *, actor: Principal = SYSTEM) -> ApiKey:
        """Revoke by id or prefix (another organisation's key reads like a missing one)."""
        key = await self.visible(ref, actor)
        may_manage(actor, key.role, "manage platform-admin keys")
        if key.revoked_at is None:
            before = snapshot(key)
            key.revoked_at = utcnow()
            key = await self.update(key)
            await self._audit(actor, "revoke", key, before, key)
        outbox(self.repository.session).keys_changed(prefix=key.prefix)
        return key

    async def update_key(self, key: ApiKey, data: ApiKeyUpdate, actor: Principal) -> ApiKey:
        may_manage(actor, key.role, "manage platform-admin keys")
        if key.revoked_at is not None:
            raise APIError(409, "This API key is revoked; create a new one.", code="conflict")
        changes = changes_of(data)
        _check_expiry(changes.get("expires_at"))
        _check_scopes(changes.get("scopes"))
        check_limits({f: changes.get(f, getattr(key, f)) for f in LIMITS})
        before = snapshot(key)
        for name, value in changes.items():
            setattr(key, name, value)
        await self.repository.session.flush()
        await self._audit(actor, "update", key, before, key)
        outbox(self.repository.session).keys_changed(prefix=key.prefix)
        return key

    async def rotate(self, key: ApiKey, *, secret_key: str, actor: Principal) -> CreatedKey:
        """A new secret with the same name, owner, role, scopes, expiry and limits; the old
        key is revoked in the same transaction."""
        may_manage(actor, key.role, "manage platform-admin keys")
        if key.revoked_at is not None:
            raise APIError(409, "This API key is revoked; create a new one instead.", code="conflict")
        if key.expires_at is not None and key.expires_at <= utcnow():
            raise APIError(409, "This API key has expired; create a new one instead.", code="conflict")
        created = await self.create_key(
            org_id=key.org_id,
            secret_key=secret_key,
            name=key.name,
            role=key.role,
            scopes=list(key.scopes) if key.scopes is not None else None,
            expires_at=key.expires_at,
            user_id=key.user_id,
            limits={f: getattr(key, f) for f in LIMITS},
            actor=actor,
        )
        before = snapshot(key)
        key.revoked_at = utcnow()
        await self.repository.session.flush()
        await self._audit(actor, "rotate", key, before, snapshot(key) | {"replaced_by": created.key.id})
        outbox(self.repository.session).keys_changed(prefix=key.prefix)
        return created


async def find_key(session: AsyncSession, prefix: str) -> tuple[ApiKey, Organization, Plan | None] | None:
    """The key with this lookup prefix, its organisation and the organisation's plan."""
    result = await session.execute(
        select(ApiKey, Organization, Plan)
        .join(Organization, Organization.id == ApiKey.org_id)
        .outerjoin(Plan, Plan.id == Organization.plan_id)
        .where(ApiKey.prefix == prefix)
    )
    row = result.first()
    return None if row is None else (row[0], row[1], row[2])


async def find_key_by_id(
    session: AsyncSession, key_id: str
) -> tuple[ApiKey, Organization, Plan | None] | None:
    """`find_key` by the key's id (whose requests a batch's lines are), revoked or not."""
    result = await session.execute(
        select(ApiKey, Organization, Plan)
        .join(Organization, Organization.id == ApiKey.org_id)
        .outerjoin(Plan, Plan.id == Organization.plan_id)
        .where(ApiKey.id == key_id)
    )
    row = result.first()
    return None if row is None else (row[0], row[1], row[2])


async def record_key_use(session: AsyncSession, used: Mapping[str, datetime]) -> None:
    """Set each key's `last_used_at` to its time in `used`, unless it already holds a later
    one (another gateway's): a last use never moves back. One statement for all of them, in
    key order, so gateways writing at once lock rows in the same order."""
    if not used:
        return
    keys = ApiKey.__table__
    at = bindparam("at", type_=keys.c.last_used_at.type)
    stmt = (
        update(keys)
        .where(keys.c.id == bindparam("key_id"), or_(keys.c.last_used_at.is_(None), keys.c.last_used_at < at))
        .values(last_used_at=at)
    )
    await session.execute(stmt, [{"key_id": key_id, "at": t} for key_id, t in sorted(used.items())])


def check_key(secret: str, key: ApiKey | None, secret_key: str) -> ApiKey:
    """`key` if `secret` is its secret and it is usable now, else a 401 APIError.
    The hash comparison is constant-time."""
    if key is None or not security.verify_key(secret, key.hash, secret_key):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    if key.revoked_at is not None:
        raise APIError(401, "This API key has been revoked.", code="invalid_api_key")
    if key.expires_at is not None and key.expires_at <= utcnow():
        raise APIError(401, "This API key has expired.", code="invalid_api_key")
    return key


async def authenticate(session: AsyncSession, secret: str, secret_key: str) -> tuple[ApiKey, Organization]:
    """The key record and its organisation, or a 401 APIError."""
    prefix = security.key_prefix(secret)
    found = await find_key(session, prefix) if prefix is not None else None
    key = check_key(secret, found[0] if found else None, secret_key)
    assert found is not None
    return key, found[1]
