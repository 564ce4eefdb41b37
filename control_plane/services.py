"""Logic of the control plane: organisations, users, keys, the model catalogue, adapters,
deployments, plans, the audit log and worker lifetimes.

Every change an admin makes goes through a method here that also writes its audit entry
into the same session, so both commit or roll back together. Methods take the acting
`Principal`; callers without one (the CLI's admin commands, the first start) act as
`SYSTEM`, which is recorded as an entry without actor ids.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import IO, TYPE_CHECKING, Any

import msgspec
from advanced_alchemy.exceptions import IntegrityError as RepositoryIntegrityError
from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from msgspec import UNSET
from sqlalchemy import func, inspect, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane import lora
from control_plane.models import (
    ROLES,
    Adapter,
    ApiKey,
    AuditEntry,
    Deployment,
    Model,
    Organization,
    Plan,
    User,
    Worker,
)
from tokenmill import security
from tokenmill.bus import Entry, EventBus
from tokenmill.db import Base, new_id, utcnow
from tokenmill.errors import APIError
from tokenmill.protocol import WORKERS, Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.tasks import GroupConsumer

if TYPE_CHECKING:
    from pathlib import Path

    from control_plane.schemas import (
        ApiKeyUpdate,
        DeploymentCreate,
        DeploymentUpdate,
        ModelCreate,
        ModelUpdate,
        OrganizationUpdate,
        PlanCreate,
        PlanUpdate,
        UserUpdate,
    )
    from tokenmill.storage import Storage

log = logging.getLogger("tokenmill.control_plane")


# --- who acts, and the audit log -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """Who makes an admin change: an admin API key today, a dashboard user's session later."""

    role: str
    org_id: str | None
    key_id: str | None = None
    user_id: str | None = None

    @property
    def is_platform_admin(self) -> bool:
        return self.role == "platform_admin"

    def sees(self, org_id: str | None) -> bool:
        """Whether resources of `org_id` are visible: platform admins see every
        organisation's; everyone else only their own."""
        return self.is_platform_admin or (org_id is not None and org_id == self.org_id)


SYSTEM = Principal(role="platform_admin", org_id=None)  # the CLI's admin commands, the first start

# Columns whose name has one of these words, or ends in "key", never reach the audit log
# (API key hashes, password hashes, cache salts, any future token, secret or API key
# column), whatever the table; ids of keys (`api_key_id`) stay.
_SECRET_WORDS = frozenset(
    {"hash", "secret", "secrets", "password", "token", "salt", "credential", "credentials"}
)


def _is_secret(column: str) -> bool:
    words = column.lower().split("_")
    return not _SECRET_WORDS.isdisjoint(words) or words[-1] in ("key", "keys")


def snapshot(row: Base) -> dict[str, Any]:
    """A row's columns as JSON-ready values, without anything secret."""
    out = {a.key: getattr(row, a.key) for a in inspect(row).mapper.column_attrs if not _is_secret(a.key)}
    return msgspec.to_builtins(out)  # datetimes as ISO 8601, Decimals as strings


async def record_change(
    session: AsyncSession,
    actor: Principal,
    action: str,
    resource_type: str,
    resource_id: str,
    *,
    org_id: str | None,
    before: Base | dict[str, Any] | None = None,
    after: Base | dict[str, Any] | None = None,
) -> AuditEntry:
    """Add an audit entry to `session` (committed with the change it describes). `before`
    and `after` are rows (snapshotted here) or snapshots taken earlier."""
    entry = AuditEntry(
        at=utcnow(),
        actor_key_id=actor.key_id,
        actor_user_id=actor.user_id,
        org_id=org_id,
        action=action,
        resource_type=resource_type,
        resource_id=resource_id,
        before=snapshot(before) if isinstance(before, Base) else before,
        after=snapshot(after) if isinstance(after, Base) else after,
    )
    session.add(entry)
    return entry


def _not_found(kind: str, ref: str) -> APIError:
    return APIError(404, f"No {kind} '{ref}'.", code="not_found")


def _forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(403, message, code="insufficient_permissions", param=param)


async def _flush_unique(session: AsyncSession, message: str, param: str) -> None:
    """Flush, turning a unique-constraint race into the same 409 the pre-check gives."""
    try:
        await session.flush()
    except (IntegrityError, RepositoryIntegrityError):
        raise APIError(409, message, param=param, code="conflict") from None


def _check_limits(values: dict[str, Any]) -> None:
    """A burst needs the rate it bursts (per-minute limits alone are valid)."""
    for burst, rate in (("request_burst", "requests_per_minute"), ("token_burst", "tokens_per_minute")):
        if values.get(burst) is not None and values.get(rate) is None:
            raise APIError(400, f"{burst} needs {rate} to be set.", param=burst)


_LIMITS = ("requests_per_minute", "tokens_per_minute", "request_burst", "token_burst", "max_concurrent")


def _changes(data: msgspec.Struct) -> dict[str, Any]:
    """The fields an update body sets (UNSET ones left out)."""
    return {f: v for f in data.__struct_fields__ if (v := getattr(data, f)) is not UNSET}


# --- organisations -------------------------------------------------------------------------


class OrganizationService(SQLAlchemyAsyncRepositoryService[Organization]):
    class Repo(SQLAlchemyAsyncRepository[Organization]):
        model_type = Organization

    repository_type = Repo

    async def create_org(
        self, name: str, *, plan_id: str | None = None, actor: Principal = SYSTEM
    ) -> Organization:
        name = name.strip()
        if not name:
            raise APIError(400, "Organisation name must not be empty.", param="name")
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
            raise APIError(404, f"No organisation '{ref}'.", code="not_found")
        return org

    async def list_visible(self, actor: Principal) -> Sequence[Organization]:
        if actor.is_platform_admin:
            return await self.get_many(order_by=[(Organization.created_at, False)])
        return await self.get_many(Organization.id == actor.org_id)

    async def update_org(self, org: Organization, data: OrganizationUpdate, actor: Principal) -> bool:
        """Rename and/or assign a plan; True if what gateways cache of it changed."""
        changes = _changes(data)
        session = self.repository.session
        before = snapshot(org)
        if "name" in changes:
            name = changes["name"].strip()
            if not name:
                raise APIError(400, "Organisation name must not be empty.", param="name")
            if name != org.name and await self.exists(name=name):
                raise APIError(409, f"An organisation named '{name}' already exists.", param="name")
            org.name = name
        plan_changed = "plan_id" in changes and changes["plan_id"] != org.plan_id
        if plan_changed:
            if changes["plan_id"] is not None:
                await _plan_ref(session, changes["plan_id"])
            org.plan_id = changes["plan_id"]
        if "billing_mode" in changes:
            # Switching never bills a period twice: billing/stripe_sync.py keeps meters and
            # mirrored invoices apart by period.
            org.billing_mode = changes["billing_mode"]
        await _flush_unique(session, f"An organisation named '{org.name}' already exists.", "name")
        await record_change(
            session, actor, "update", "organization", org.id, org_id=org.id, before=before, after=org
        )
        return plan_changed

    async def set_status(self, org: Organization, status: str, actor: Principal) -> None:
        """Suspend (`suspended`: the gateway refuses every key of it) or resume (`active`)."""
        if org.status == status:
            return
        before = snapshot(org)
        org.status = status
        await self.repository.session.flush()
        action = "suspend" if status == "suspended" else "resume"
        await record_change(
            self.repository.session,
            actor,
            action,
            "organization",
            org.id,
            org_id=org.id,
            before=before,
            after=org,
        )


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
        if role not in ROLES:
            raise APIError(400, f"role must be one of {', '.join(ROLES)}.", param="role")
        if role == "platform_admin" and not actor.is_platform_admin:
            raise _forbidden("Only platform admins create platform admins.", "role")
        if await self.exists(email=email):
            raise APIError(409, f"A user with email '{email}' already exists.", param="email")
        # argon2 is deliberately slow (tens of ms): keep it off the event loop.
        hashed = await asyncio.to_thread(security.hash_password, password)
        user = User(org_id=org_id, email=email, password_hash=hashed, role=role)
        self.repository.session.add(user)
        await _flush_unique(self.repository.session, f"A user with email '{email}' already exists.", "email")
        await record_change(
            self.repository.session, actor, "create", "user", user.id, org_id=org_id, after=user
        )
        return user

    async def list_for_org(self, org_id: str) -> list[User]:
        return list(await self.get_many(User.org_id == org_id, order_by=[(User.created_at, False)]))

    async def visible(self, user_id: str, actor: Principal) -> User:
        user = await self.get_one_or_none(User.id == user_id)
        if user is None or not actor.sees(user.org_id):
            raise _not_found("user", user_id)
        return user

    async def update_user(self, user: User, data: UserUpdate, actor: Principal) -> list[str]:
        """Change role, password or disabled; disabling revokes the user's API keys.
        Returns the prefixes of the keys revoked (for the gateways to drop)."""
        changes = _changes(data)
        session = self.repository.session
        if user.role == "platform_admin" and not actor.is_platform_admin:
            raise _forbidden("Only platform admins change platform admins.")
        if changes.get("role") == "platform_admin" and not actor.is_platform_admin:
            raise _forbidden("Only platform admins make platform admins.", "role")
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
        await session.flush()
        after = snapshot(user)
        # The hash itself never reaches the log; that it changed does.
        if "password" in changes:
            after["password_changed"] = True
        await record_change(
            session, actor, "update", "user", user.id, org_id=user.org_id, before=before, after=after
        )
        return revoked

    async def authenticate(self, email: str, password: str) -> User | None:
        """The enabled user with this email and password, else None (for the dashboard's
        login, issue 8). Verifies against a dummy hash when the email is unknown, so the
        answer takes as long either way."""
        user = await self.get_one_or_none(User.email == email.strip().lower())
        stored = user.password_hash if user is not None and user.password_hash else _dummy_hash()
        ok = await asyncio.to_thread(security.verify_password, password, stored)
        if user is None or not ok or user.disabled:
            return None
        return user


@functools.cache
def _dummy_hash() -> str:
    return security.hash_password("not a real password")


# --- API keys ------------------------------------------------------------------------------


@dataclass(slots=True)
class CreatedKey:
    key: ApiKey
    secret: str


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
        if role not in ROLES:
            raise APIError(400, f"role must be one of {', '.join(ROLES)}.", param="role")
        if role == "platform_admin" and not actor.is_platform_admin:
            raise _forbidden("Only platform admins create platform-admin keys.", "role")
        if expires_at is not None and expires_at <= utcnow():
            raise APIError(400, "expires_at must be in the future.", param="expires_at")
        if scopes is not None and len(set(scopes)) != len(scopes):
            raise APIError(400, "scopes lists a model twice.", param="scopes")
        limits = dict(limits or {})
        _check_limits(limits)
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
        await record_change(
            self.repository.session, actor, "create", "api_key", key.id, org_id=org_id, after=key
        )
        return CreatedKey(key, new.secret)

    async def list_for_org(self, org_id: str) -> list[ApiKey]:
        return list(await self.get_many(ApiKey.org_id == org_id, order_by=[(ApiKey.created_at, False)]))

    async def visible(self, ref: str, actor: Principal) -> ApiKey:
        """By id or prefix, if `actor` may see it."""
        key = await self.get_one_or_none(or_(ApiKey.id == ref, ApiKey.prefix == ref))
        if key is None or not actor.sees(key.org_id):
            raise APIError(404, f"No API key '{ref}'.", code="not_found")
        return key

    def _may_manage(self, key: ApiKey, actor: Principal) -> None:
        if key.role == "platform_admin" and not actor.is_platform_admin:
            raise _forbidden("Only platform admins manage platform-admin keys.")

    async def revoke(self, ref: str, *, org_id: str | None = None, actor: Principal = SYSTEM) -> ApiKey:
        """Revoke by id or prefix; `org_id` confines the lookup to one tenant."""
        filters = [or_(ApiKey.id == ref, ApiKey.prefix == ref)]
        if org_id is not None:
            filters.append(ApiKey.org_id == org_id)
        key = await self.get_one_or_none(*filters)
        if key is None:
            raise APIError(404, f"No API key '{ref}'.", code="not_found")
        self._may_manage(key, actor)
        if key.revoked_at is None:
            before = snapshot(key)
            key.revoked_at = utcnow()
            key = await self.update(key)
            await record_change(
                self.repository.session,
                actor,
                "revoke",
                "api_key",
                key.id,
                org_id=key.org_id,
                before=before,
                after=key,
            )
        return key

    async def update_key(self, key: ApiKey, data: ApiKeyUpdate, actor: Principal) -> ApiKey:
        self._may_manage(key, actor)
        if key.revoked_at is not None:
            raise APIError(409, "This API key is revoked; create a new one.", code="conflict")
        changes = _changes(data)
        if changes.get("expires_at") is not None and changes["expires_at"] <= utcnow():
            raise APIError(400, "expires_at must be in the future.", param="expires_at")
        if changes.get("scopes") is not None and len(set(changes["scopes"])) != len(changes["scopes"]):
            raise APIError(400, "scopes lists a model twice.", param="scopes")
        _check_limits({f: changes.get(f, getattr(key, f)) for f in _LIMITS})
        before = snapshot(key)
        for name, value in changes.items():
            setattr(key, name, value)
        await self.repository.session.flush()
        await record_change(
            self.repository.session,
            actor,
            "update",
            "api_key",
            key.id,
            org_id=key.org_id,
            before=before,
            after=key,
        )
        return key

    async def rotate(self, key: ApiKey, *, secret_key: str, actor: Principal) -> CreatedKey:
        """A new secret with the same name, owner, role, scopes, expiry and limits; the old
        key is revoked in the same transaction."""
        self._may_manage(key, actor)
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
            limits={f: getattr(key, f) for f in _LIMITS},
            actor=actor,
        )
        before = snapshot(key)
        key.revoked_at = utcnow()
        await self.repository.session.flush()
        after = snapshot(key) | {"replaced_by": created.key.id}
        await record_change(
            self.repository.session,
            actor,
            "rotate",
            "api_key",
            key.id,
            org_id=key.org_id,
            before=before,
            after=after,
        )
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


class CatalogService:
    """Models and the deployments that serve them."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def ensure_model(
        self, *, name: str, source: str, format: str, kind: str, context_length: int
    ) -> Model:
        model = await self.session.scalar(select(Model).where(Model.name == name))
        if model is None:
            model = Model(name=name, source=source, format=format, kind=kind, context_length=context_length)
            self.session.add(model)
            await self.session.flush()
            await record_change(self.session, SYSTEM, "create", "model", model.id, org_id=None, after=model)
        return model

    async def ensure_serverless(self, model: Model, sampling: dict[str, float] | None = None) -> Deployment:
        """The shared deployment of a model; `sampling` holds defaults for parameters a
        request leaves out (as vLLM applies a model's generation config)."""
        dep = await self.session.scalar(
            select(Deployment).where(Deployment.name == model.name, Deployment.org_id.is_(None))
        )
        if dep is None:
            dep = Deployment(
                name=model.name,
                model_id=model.id,
                kind=model.kind,
                type="serverless",
                config={"sampling": sampling or {}},
            )
            self.session.add(dep)
            await self.session.flush()
            await record_change(self.session, SYSTEM, "create", "deployment", dep.id, org_id=None, after=dep)
        return dep

    async def visible_deployments(self, org_id: str) -> list[tuple[Deployment, Model]]:
        """Serverless deployments plus the organisation's own dedicated ones."""
        result = await self.session.execute(
            select(Deployment, Model)
            .join(Model, Model.id == Deployment.model_id)
            .where(Deployment.status == "active")
            .where(or_(Deployment.org_id.is_(None), Deployment.org_id == org_id))
            .order_by(Deployment.name)
        )
        return [(d, m) for d, m in result.all()]

    async def adapters(self, org_id: str) -> list[Adapter]:
        """The organisation's own LoRA adapters (no one else's, ever)."""
        result = await self.session.scalars(
            select(Adapter).where(Adapter.org_id == org_id).order_by(Adapter.name)
        )
        return list(result)

    async def resolve(self, name: str, org_id: str) -> tuple[Deployment, Model, Adapter | None]:
        """A model name as a caller of `org_id` sees it: a deployment it may use, or one of
        its own adapters, served by the shared deployment of the adapter's base model."""
        visible = await self.visible_deployments(org_id)
        for dep, model in visible:
            if dep.name == name:
                return dep, model, None
        adapter = await self.session.scalar(
            select(Adapter).where(Adapter.org_id == org_id, Adapter.name == name)
        )
        if adapter is not None:
            for dep, model in visible:
                if model.id == adapter.model_id and dep.org_id is None:
                    return dep, model, adapter
        raise APIError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )


# --- the catalogue, as admins change it ---------------------------------------------------------


async def _model_ref(session: AsyncSession, ref: str, param: str = "model") -> Model:
    """A base model named in a request body, by id or name (400 naming `param` if none)."""
    model = await session.scalar(select(Model).where(or_(Model.id == ref, Model.name == ref)))
    if model is None:
        raise APIError(400, f"No model '{ref}'.", param=param)
    return model


async def _plan_ref(session: AsyncSession, plan_id: str) -> Plan:
    plan = await session.get(Plan, plan_id)
    if plan is None:
        raise APIError(400, f"No plan '{plan_id}'.", param="plan_id")
    return plan


class ModelService(SQLAlchemyAsyncRepositoryService[Model]):
    """Base models: written by platform admins, read by every admin."""

    class Repo(SQLAlchemyAsyncRepository[Model]):
        model_type = Model

    repository_type = Repo

    async def get_ref(self, ref: str) -> Model:
        model = await self.get_one_or_none(or_(Model.id == ref, Model.name == ref))
        if model is None:
            raise _not_found("model", ref)
        return model

    async def create_model(self, data: ModelCreate, actor: Principal) -> Model:
        session = self.repository.session
        if await self.exists(name=data.name):
            raise APIError(409, f"A model named '{data.name}' already exists.", param="name")
        _check_source(data.source, data.format)
        model = Model(
            name=data.name,
            source=data.source.strip(),
            format=data.format,
            kind=data.kind,
            context_length=data.context_length,
        )
        session.add(model)
        await _flush_unique(session, f"A model named '{data.name}' already exists.", "name")
        await record_change(session, actor, "create", "model", model.id, org_id=None, after=model)
        return model

    async def update_model(self, model: Model, data: ModelUpdate, actor: Principal) -> Model:
        changes = _changes(data)
        _check_source(changes.get("source", model.source), changes.get("format", model.format))
        before = snapshot(model)
        for name, value in changes.items():
            setattr(model, name, value.strip() if name == "source" else value)
        await self.repository.session.flush()
        await record_change(
            self.repository.session,
            actor,
            "update",
            "model",
            model.id,
            org_id=None,
            before=before,
            after=model,
        )
        return model

    async def delete_model(self, model: Model, actor: Principal) -> None:
        """Only a model nothing uses: deleting one would cascade to tenants' deployments and
        adapters (and their stored files)."""
        session = self.repository.session
        deployments = await session.scalar(select(func.count()).where(Deployment.model_id == model.id))
        adapters = await session.scalar(select(func.count()).where(Adapter.model_id == model.id))
        if deployments or adapters:
            raise APIError(
                409,
                f"Model '{model.name}' is used by {deployments} deployment(s) and {adapters} adapter(s); "
                "delete those first.",
                code="conflict",
            )
        before = snapshot(model)
        await session.delete(model)
        await session.flush()
        await record_change(session, actor, "delete", "model", model.id, org_id=None, before=before)


def _check_source(source: str, format: str) -> None:
    source = source.strip()
    if not source:
        raise APIError(400, "source must not be empty.", param="source")
    if format == "gguf" and not (source.endswith(".gguf") or source.startswith(("bundled:", "store:"))):
        raise APIError(
            400,
            "A gguf model's source must be a .gguf file, bundled:<name> or store:<prefix holding one>.",
            param="source",
        )


def deployment_adapters(dep: Deployment) -> list[str]:
    return list((dep.config or {}).get("adapters") or [])


class DeploymentService(SQLAlchemyAsyncRepositoryService[Deployment]):
    """The shared serverless deployments (platform admins) and organisations' dedicated ones."""

    class Repo(SQLAlchemyAsyncRepository[Deployment]):
        model_type = Deployment

    repository_type = Repo

    async def list_visible(self, actor: Principal, org_id: str | None = None) -> list[Deployment]:
        """Serverless deployments and the dedicated ones `actor` may see (of `org_id` only,
        when given)."""
        query = select(Deployment).order_by(Deployment.name)
        if org_id is not None:
            query = query.where(Deployment.org_id == org_id)
        elif not actor.is_platform_admin:
            query = query.where(or_(Deployment.org_id.is_(None), Deployment.org_id == actor.org_id))
        return list(await self.repository.session.scalars(query))

    async def visible(self, dep_id: str, actor: Principal) -> Deployment:
        dep = await self.get_one_or_none(Deployment.id == dep_id)
        # Serverless deployments are everyone's to read; dedicated ones their owner's.
        if dep is None or (dep.org_id is not None and not actor.sees(dep.org_id)):
            raise _not_found("deployment", dep_id)
        return dep

    def _may_change(self, dep: Deployment, actor: Principal) -> None:
        if dep.org_id is None and not actor.is_platform_admin:
            raise _forbidden("Only platform admins change serverless deployments.")

    async def create_deployment(self, data: DeploymentCreate, actor: Principal) -> Deployment:
        session = self.repository.session
        model = await _model_ref(session, data.model)
        if data.type == "serverless":
            if not actor.is_platform_admin:
                raise _forbidden("Only platform admins create serverless deployments.", "type")
            if data.org_id is not None:
                raise APIError(400, "A serverless deployment is shared; it has no org_id.", param="org_id")
            if data.adapters:
                raise APIError(
                    400,
                    "Serverless deployments serve every organisation's own adapters by name; "
                    "adapters can only be pinned to a dedicated deployment.",
                    param="adapters",
                )
            org_id = None
        else:
            org_id = (
                data.org_id
                if data.org_id is not None
                else (None if actor.is_platform_admin else actor.org_id)
            )
            if org_id is None:
                raise APIError(400, "A dedicated deployment needs the org_id that owns it.", param="org_id")
            if not actor.sees(org_id) or await session.get(Organization, org_id) is None:
                raise APIError(404, f"No organisation '{org_id}'.", code="not_found", param="org_id")
        _check_replicas(data.min_replicas, data.max_replicas)
        await self._check_name(data.name, org_id)
        adapters = await _check_adapters(session, data.adapters, org_id, model.id)
        config: dict[str, Any] = {"adapters": adapters} if adapters else {}
        if data.autoscaling is not None and (scaling := msgspec.to_builtins(data.autoscaling)):
            config["autoscaling"] = scaling
        dep = Deployment(
            name=data.name,
            model_id=model.id,
            org_id=org_id,
            kind=model.kind,
            type=data.type,
            gpu_type=data.gpu_type,
            min_replicas=data.min_replicas,
            max_replicas=data.max_replicas,
            status=data.status,
            config=config or None,
        )
        session.add(dep)
        await _flush_unique(session, f"A deployment named '{data.name}' already exists.", "name")
        await record_change(session, actor, "create", "deployment", dep.id, org_id=org_id, after=dep)
        return dep

    async def _check_name(self, name: str, org_id: str | None) -> None:
        session = self.repository.session
        if await self.exists(name=name):
            raise APIError(409, f"A deployment named '{name}' already exists.", param="name")
        # Clients name adapters and deployments alike as `model`; a deployment would hide an
        # adapter of the same name from its organisation (or, if serverless, from every one).
        clash = select(Adapter.id).where(Adapter.name == name)
        if org_id is not None:
            clash = clash.where(Adapter.org_id == org_id)
        if await session.scalar(clash.limit(1)) is not None:
            raise APIError(409, f"An adapter named '{name}' already exists.", param="name")

    async def update_deployment(
        self, dep: Deployment, data: DeploymentUpdate, actor: Principal
    ) -> Deployment:
        self._may_change(dep, actor)
        session = self.repository.session
        changes = _changes(data)
        _check_replicas(
            changes.get("min_replicas", dep.min_replicas), changes.get("max_replicas", dep.max_replicas)
        )
        before = snapshot(dep)
        if "adapters" in changes:
            if dep.org_id is None and changes["adapters"]:
                raise APIError(
                    400, "Adapters can only be pinned to a dedicated deployment.", param="adapters"
                )
            adapters = await _check_adapters(session, changes.pop("adapters"), dep.org_id, dep.model_id)
            # A new dict, so SQLAlchemy sees the JSON column change.
            config = {k: v for k, v in (dep.config or {}).items() if k != "adapters"}
            if adapters:
                config["adapters"] = adapters
            dep.config = config or None
        if "autoscaling" in changes:
            scaling = msgspec.to_builtins(changes.pop("autoscaling"))
            config = {k: v for k, v in (dep.config or {}).items() if k != "autoscaling"}
            if scaling:
                config["autoscaling"] = scaling
            dep.config = config or None
        for name, value in changes.items():
            setattr(dep, name, value)
        await session.flush()
        await record_change(
            session, actor, "update", "deployment", dep.id, org_id=dep.org_id, before=before, after=dep
        )
        return dep

    async def delete_deployment(self, dep: Deployment, actor: Principal) -> None:
        """Only a deployment that never ran: dedicated deployments are billed from their
        workers' lifetimes, which must keep pointing at them. Stop it instead."""
        self._may_change(dep, actor)
        session = self.repository.session
        if await session.scalar(select(Worker.id).where(Worker.deployment_id == dep.id).limit(1)) is not None:
            raise APIError(
                409,
                f"Deployment '{dep.name}' has run workers, whose lifetimes are billed; set its status "
                "to 'stopped' instead.",
                code="conflict",
            )
        before = snapshot(dep)
        await session.delete(dep)
        await session.flush()
        await record_change(session, actor, "delete", "deployment", dep.id, org_id=dep.org_id, before=before)


def _check_replicas(low: int, high: int) -> None:
    if high < 1:
        raise APIError(400, "max_replicas must be at least 1.", param="max_replicas")
    if low > high:
        raise APIError(400, f"min_replicas ({low}) exceeds max_replicas ({high}).", param="min_replicas")


async def _check_adapters(
    session: AsyncSession, ids: list[str], org_id: str | None, model_id: str
) -> list[str]:
    """Adapter ids pinned to a deployment: each the owner's own, on the same base model."""
    if len(set(ids)) != len(ids):
        raise APIError(400, "adapters lists an adapter twice.", param="adapters")
    for adapter_id in ids:
        adapter = await session.get(Adapter, adapter_id)
        # Another organisation's adapter reads exactly like a missing one.
        if adapter is None or adapter.org_id != org_id:
            raise APIError(400, f"No adapter '{adapter_id}' in this organisation.", param="adapters")
        if adapter.model_id != model_id:
            raise APIError(
                400,
                f"Adapter '{adapter_id}' is for another base model than the deployment's.",
                param="adapters",
            )
    return ids


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def _base_shapes(source: str, cache_dir: Path, storage: Storage) -> lora.BaseShapes:
    """Shapes of a base model's linear layers, from its config.json (blocking: resolving
    may fetch a stored model or convert a GGUF, once)."""
    from tokenmill.modelstore import resolve_model

    model_dir = resolve_model(source, cache_dir, storage=storage)
    return lora.BaseShapes.from_config(json.loads((model_dir / "config.json").read_text()))


class AdapterService(SQLAlchemyAsyncRepositoryService[Adapter]):
    """LoRA adapters: files in storage, a row per adapter, each owned by one organisation."""

    class Repo(SQLAlchemyAsyncRepository[Adapter]):
        model_type = Adapter

    repository_type = Repo

    async def list_for_org(self, org_id: str) -> list[Adapter]:
        return list(await self.get_many(Adapter.org_id == org_id, order_by=[(Adapter.name, False)]))

    async def visible(self, adapter_id: str, actor: Principal) -> Adapter:
        adapter = await self.get_one_or_none(Adapter.id == adapter_id)
        if adapter is None or not actor.sees(adapter.org_id):
            raise _not_found("adapter", adapter_id)
        return adapter

    async def _base(self, model_ref: str, cache_dir: Path, storage: Storage) -> tuple[Model, lora.BaseShapes]:
        """The base model an adapter is for, and its layer shapes (400 if it takes none)."""
        model = await _model_ref(self.repository.session, model_ref)
        if model.kind != "generate":
            raise APIError(
                400, f"Model '{model.name}' computes embeddings; it takes no adapters.", param="model"
            )
        try:
            shapes = await asyncio.to_thread(_base_shapes, model.source, cache_dir, storage)
        except (OSError, ValueError) as exc:
            raise APIError(
                400, f"The base model '{model.name}' cannot be checked for adapters: {exc}", param="model"
            ) from None
        return model, shapes

    async def weights_limit(
        self, model_ref: str, *, cache_dir: Path, storage: Storage, max_rank: int
    ) -> tuple[str, int]:
        """(base model name, size of the largest weights file `create_adapter` accepts for it):
        what an upload may send before it is refused, decided before its files arrive."""
        model, shapes = await self._base(model_ref, cache_dir, storage)
        return model.name, lora.max_weights_size(shapes, max_rank)

    async def create_adapter(
        self,
        *,
        org_id: str,
        name: str,
        model_ref: str,
        config_raw: bytes,
        weights: IO[bytes],
        weights_size: int,
        storage: Storage,
        cache_dir: Path,
        max_rank: int,
        actor: Principal,
    ) -> Adapter:
        """Validate the two PEFT files against the base model, store them, add the row.

        The files are written before the row and removed again if the row cannot be added,
        so a failed upload leaves nothing behind."""
        session = self.repository.session
        name = name.strip()
        if not _ADAPTER_NAME.match(name):
            raise APIError(
                400,
                "name must be 1-200 letters, digits or . _ : / @ + - (starting with a letter or digit).",
                param="name",
            )
        if await self.exists(org_id=org_id, name=name):
            raise APIError(409, f"This organisation already has an adapter named '{name}'.", param="name")
        visible_names = select(Deployment.id).where(
            Deployment.name == name, or_(Deployment.org_id.is_(None), Deployment.org_id == org_id)
        )
        if await session.scalar(visible_names.limit(1)) is not None:
            raise APIError(409, f"A deployment named '{name}' exists; pick another name.", param="name")
        model, shapes = await self._base(model_ref, cache_dir, storage)
        info = await asyncio.to_thread(lora.validate, config_raw, weights, weights_size, shapes, max_rank)

        adapter_id = new_id("adapter")
        prefix = f"adapters/{org_id}/{adapter_id}/"

        def store() -> int:
            weights.seek(0)
            size = storage.put(prefix + lora.CONFIG_FILE, config_raw)
            return size + storage.put(prefix + lora.WEIGHTS_FILE, weights)

        try:
            size = await asyncio.to_thread(store)
            adapter = Adapter(
                id=adapter_id,
                org_id=org_id,
                model_id=model.id,
                name=name,
                source=storage.uri(prefix.rstrip("/")),
                rank=info.rank,
                target_modules=info.target_modules,
                storage_key=prefix,
                size_bytes=size,
                sha256=info.sha256,
            )
            session.add(adapter)
            await _flush_unique(session, f"This organisation already has an adapter named '{name}'.", "name")
            await record_change(session, actor, "create", "adapter", adapter.id, org_id=org_id, after=adapter)
        except BaseException:
            await asyncio.to_thread(_forget_files, storage, prefix)
            raise
        return adapter

    async def delete_adapter(self, adapter: Adapter, actor: Principal) -> str | None:
        """Remove the row (refused while a deployment pins it); returns the storage prefix
        whose files the caller removes once the deletion is committed."""
        session = self.repository.session
        deps = await session.scalars(
            select(Deployment).where(Deployment.org_id == adapter.org_id, Deployment.config.is_not(None))
        )
        for dep in deps:
            if adapter.id in deployment_adapters(dep):
                raise APIError(
                    409,
                    f"Deployment '{dep.name}' serves this adapter; remove it from the deployment first.",
                    code="conflict",
                )
        before = snapshot(adapter)
        await session.delete(adapter)
        await session.flush()
        await record_change(
            session, actor, "delete", "adapter", adapter.id, org_id=adapter.org_id, before=before
        )
        return adapter.storage_key


def _forget_files(storage: Storage, prefix: str) -> None:
    try:
        storage.delete_prefix(prefix)
    except Exception:  # the storage may be what failed; the files are unreferenced either way
        log.exception("could not remove stored files under %s", prefix)


def remove_adapter_files(storage: Storage, prefix: str) -> None:
    """Blocking: remove a deleted adapter's files (after the deletion committed)."""
    _forget_files(storage, prefix)


# --- plans ---------------------------------------------------------------------------------

_BUDGET_MAX = Decimal(10) ** 10  # Numeric(14, 4)


def _check_budget(budget: Decimal | None, mode: str) -> None:
    if budget is not None:
        if not budget.is_finite() or budget < 0 or budget >= _BUDGET_MAX:
            raise APIError(
                400, "monthly_budget must be a non-negative amount below 10^10.", param="monthly_budget"
            )
        exponent = budget.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -4:
            raise APIError(400, "monthly_budget has more than 4 decimal places.", param="monthly_budget")
    elif mode == "hard":
        raise APIError(400, "budget_mode 'hard' needs a monthly_budget.", param="budget_mode")


class PlanService(SQLAlchemyAsyncRepositoryService[Plan]):
    class Repo(SQLAlchemyAsyncRepository[Plan]):
        model_type = Plan

    repository_type = Repo

    async def get_ref(self, plan_id: str) -> Plan:
        plan = await self.get_one_or_none(Plan.id == plan_id)
        if plan is None:
            raise _not_found("plan", plan_id)
        return plan

    async def create_plan(self, data: PlanCreate, actor: Principal) -> Plan:
        values = msgspec.structs.asdict(data)
        values["name"] = values["name"].strip()
        if not values["name"]:
            raise APIError(400, "Plan name must not be empty.", param="name")
        _check_limits(values)
        _check_budget(data.monthly_budget, data.budget_mode)
        if await self.exists(name=values["name"]):
            raise APIError(409, f"A plan named '{values['name']}' already exists.", param="name")
        plan = Plan(**values)
        self.repository.session.add(plan)
        await _flush_unique(
            self.repository.session, f"A plan named '{values['name']}' already exists.", "name"
        )
        await record_change(
            self.repository.session, actor, "create", "plan", plan.id, org_id=None, after=plan
        )
        return plan

    async def update_plan(self, plan: Plan, data: PlanUpdate, actor: Principal) -> list[str]:
        """Returns the organisations on this plan (whose cached limits gateways must drop)."""
        session = self.repository.session
        changes = _changes(data)
        if "name" in changes:
            changes["name"] = changes["name"].strip()
            if not changes["name"]:
                raise APIError(400, "Plan name must not be empty.", param="name")
            if changes["name"] != plan.name and await self.exists(name=changes["name"]):
                raise APIError(409, f"A plan named '{changes['name']}' already exists.", param="name")
        _check_limits({f: changes.get(f, getattr(plan, f)) for f in _LIMITS})
        _check_budget(
            changes.get("monthly_budget", plan.monthly_budget), changes.get("budget_mode", plan.budget_mode)
        )
        before = snapshot(plan)
        for name, value in changes.items():
            setattr(plan, name, value)
        await _flush_unique(session, f"A plan named '{plan.name}' already exists.", "name")
        await record_change(session, actor, "update", "plan", plan.id, org_id=None, before=before, after=plan)
        return list(await session.scalars(select(Organization.id).where(Organization.plan_id == plan.id)))

    async def delete_plan(self, plan: Plan, actor: Principal) -> None:
        session = self.repository.session
        used = await session.scalar(select(func.count()).where(Organization.plan_id == plan.id))
        if used:
            raise APIError(
                409, f"{used} organisation(s) are on plan '{plan.name}'; move them first.", code="conflict"
            )
        before = snapshot(plan)
        await session.delete(plan)
        await session.flush()
        await record_change(session, actor, "delete", "plan", plan.id, org_id=None, before=before)


# --- reading the audit log -----------------------------------------------------------------


@dataclass(slots=True)
class AuditQuery:
    org_id: str | None = None
    resource_type: str | None = None
    resource_id: str | None = None
    action: str | None = None
    actor_key_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after: int | None = None  # the id of the last entry of the previous page
    limit: int = 100


class AuditService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def page(self, query: AuditQuery, actor: Principal) -> tuple[list[AuditEntry], bool]:
        """Entries newest first, and whether more follow. Organisation admins read their
        own organisation's entries only (asking for another's is a 404)."""
        org_id = query.org_id
        if not actor.is_platform_admin:
            if org_id is not None and org_id != actor.org_id:
                raise APIError(404, f"No organisation '{org_id}'.", code="not_found", param="org_id")
            org_id = actor.org_id
        stmt = select(AuditEntry)
        for column, value in (
            (AuditEntry.org_id, org_id),
            (AuditEntry.resource_type, query.resource_type),
            (AuditEntry.resource_id, query.resource_id),
            (AuditEntry.action, query.action),
            (AuditEntry.actor_key_id, query.actor_key_id),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if query.since is not None:
            stmt = stmt.where(AuditEntry.at >= query.since)
        if query.until is not None:
            stmt = stmt.where(AuditEntry.at < query.until)
        if query.after is not None:
            stmt = stmt.where(AuditEntry.id < query.after)
        rows = list(await self.session.scalars(stmt.order_by(AuditEntry.id.desc()).limit(query.limit + 1)))
        return rows[: query.limit], len(rows) > query.limit


@dataclass(slots=True)
class EmbedSpec:
    """An embedding model the embedded server serves next to its chat model."""

    name: str
    source: str
    context_length: int
    format: str = "hf"


@dataclass(slots=True)
class Bootstrap:
    org: Organization
    admin_secret: str | None  # only on the very first start
    deployment: Deployment
    model: Model
    embed_deployment: Deployment | None = None
    embed_model: Model | None = None
    # (email, password) of a platform admin created for the dashboard's sign-in when no
    # platform admin could sign in yet; the password is shown once, like the key.
    admin_login: tuple[str, str] | None = None


async def _ensure_admin_login(session: AsyncSession, org_id: str, email: str) -> tuple[str, str] | None:
    """A platform-admin user with a generated password, unless one can already sign in (or
    the address is taken, e.g. by a disabled user: then it is the admins' call)."""
    can_sign_in = select(User.id).where(
        User.role == "platform_admin", User.password_hash.is_not(None), User.disabled.is_(False)
    )
    users = UserService(session=session)
    if await session.scalar(can_sign_in.limit(1)) is not None or await users.exists(email=email):
        return None
    password = secrets.token_urlsafe(18)
    user = await users.create_user(org_id=org_id, email=email, password=password, role="platform_admin")
    return user.email, password


async def bootstrap(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    secret_key: str,
    model_name: str,
    model_source: str,
    model_format: str,
    context_length: int,
    sampling: dict[str, float] | None = None,
    embed: EmbedSpec | None = None,
    dashboard_admin: str | None = None,
) -> Bootstrap:
    """First start: an organisation and a platform-admin key. Every start: the served model,
    and the embedding model (kind `embed`) with its serverless deployment when `embed` is given;
    with `dashboard_admin` (an email), a platform-admin user to sign in to the dashboard with,
    if no platform admin can sign in yet."""
    async with sessionmaker() as session, session.begin():
        orgs = OrganizationService(session=session)
        secret = None
        org = await orgs.get_one_or_none(name="default")
        if await orgs.count() == 0:
            org = await orgs.create_org("default")
            created = await ApiKeyService(session=session).create_key(
                org_id=org.id, secret_key=secret_key, name="bootstrap admin", role="platform_admin"
            )
            secret = created.secret
        elif org is None:
            org = (await orgs.get_many(order_by=[(Organization.created_at, False)]))[0]
        catalog = CatalogService(session)
        model = await catalog.ensure_model(
            name=model_name,
            source=model_source,
            format=model_format,
            kind="generate",
            context_length=context_length,
        )
        dep = await catalog.ensure_serverless(model, sampling)
        embed_model = embed_dep = None
        if embed is not None:
            embed_model = await catalog.ensure_model(
                name=embed.name,
                source=embed.source,
                format=embed.format,
                kind="embed",
                context_length=embed.context_length,
            )
            embed_dep = await catalog.ensure_serverless(embed_model)
        login = await _ensure_admin_login(session, org.id, dashboard_admin) if dashboard_admin else None
    return Bootstrap(
        org=org,
        admin_secret=secret,
        deployment=dep,
        model=model,
        embed_deployment=embed_dep,
        embed_model=embed_model,
        admin_login=login,
    )


class WorkerLifetimes(GroupConsumer):
    """Records each worker's start and stop (what dedicated deployments are billed on).

    Last-seen times are written at most every few seconds per worker.
    """

    name = "worker-lifetimes"
    stream = WORKERS
    group = "control-plane-workers"

    def __init__(self, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], consumer: str) -> None:
        super().__init__(bus, consumer)
        self.sessionmaker = sessionmaker
        self._seen: dict[str, float] = {}
        self._decoder = msgspec.json.Decoder(WorkerEvent)

    async def handle(self, entries: list[Entry]) -> None:
        await self.apply([self._decoder.decode(raw) for _, raw in entries])

    async def apply(self, events: list[WorkerEvent]) -> None:
        async with self.sessionmaker() as session, session.begin():
            for ev in events:
                ts = datetime.fromtimestamp(ev.ts, UTC) if ev.ts else utcnow()
                if isinstance(ev, WorkerAnnounce | Heartbeat):
                    if isinstance(ev, Heartbeat) and ev.ts - self._seen.get(ev.worker_id, 0.0) < 5.0:
                        continue
                    self._seen[ev.worker_id] = ev.ts
                    worker = await session.get(Worker, ev.worker_id)
                    if worker is None:
                        session.add(
                            Worker(
                                id=ev.worker_id,
                                deployment_id=await _known_deployment(session, ev.deployment_id),
                                address=ev.address,
                                model=ev.model,
                                gpu_type=getattr(ev, "gpu_type", None),
                                started_at=ts,
                                last_seen_at=ts,
                            )
                        )
                        await session.flush()
                    elif worker.stopped_at is None:
                        worker.last_seen_at = ts
                elif isinstance(ev, WorkerDeparture):
                    # A lost worker (declared gone by the reconciler) stops at its last
                    # heartbeat: no unseen time is billed, and none that was seen is dropped.
                    self._seen.pop(ev.worker_id, None)
                    await session.execute(
                        update(Worker)
                        .where(Worker.id == ev.worker_id, Worker.stopped_at.is_(None))
                        .values(stopped_at=ts, last_seen_at=ts, status="lost" if ev.lost else "stopped")
                    )


async def _known_deployment(session: AsyncSession, deployment_id: str | None) -> str | None:
    # A worker started by hand may name a deployment this database does not know.
    if deployment_id and await session.get(Deployment, deployment_id) is not None:
        return deployment_id
    return None
