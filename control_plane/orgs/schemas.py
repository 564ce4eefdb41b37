"""Wire types of organisations, users and API keys."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from control_plane.wire import Body, Limit, Name

Role = Literal["platform_admin", "org_admin", "member"]


# --- organisations ---------------------------------------------------------------------


class OrganizationCreate(Body):
    name: Name
    plan_id: str | None = None


class OrganizationUpdate(Body):
    name: Name | UnsetType = UNSET
    plan_id: str | UnsetType | None = UNSET  # null: the platform's default tier
    # How Stripe bills it (never both): local invoices mirrored, or usage as meter events.
    billing_mode: Literal["none", "invoices", "meters"] | UnsetType = UNSET


class OrganizationOut(msgspec.Struct):
    id: str
    name: str
    status: str
    plan_id: str | None
    billing_mode: str
    created_at: datetime


# --- users -----------------------------------------------------------------------------

Email = Annotated[str, Meta(min_length=3, max_length=320)]
Password = Annotated[str, Meta(min_length=8, max_length=1024)]


class UserCreate(Body):
    email: Email
    password: Password
    role: Role = "member"


class UserUpdate(Body):
    role: Role | UnsetType = UNSET
    disabled: bool | UnsetType = UNSET
    password: Password | UnsetType = UNSET


class UserOut(msgspec.Struct):
    """Never carries the password hash."""

    id: str
    org_id: str | None
    email: str
    role: str
    disabled: bool
    created_at: datetime


# --- API keys --------------------------------------------------------------------------

Scope = Annotated[str, Meta(min_length=1, max_length=200)]
Scopes = Annotated[list[Scope], Meta(min_length=1, max_length=100)]


class ApiKeyCreate(Body):
    name: Annotated[str, Meta(max_length=200)] = ""
    role: str = "member"
    scopes: Scopes | None = None  # model names the key may use; null: all
    expires_at: datetime | None = None
    user_id: str | None = None  # the user the key belongs to (revoked when they are disabled)
    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None
    request_burst: Limit | None = None
    token_burst: Limit | None = None
    max_concurrent: Limit | None = None


class ApiKeyUpdate(Body):
    name: Annotated[str, Meta(max_length=200)] | UnsetType = UNSET
    scopes: Scopes | UnsetType | None = UNSET
    expires_at: datetime | UnsetType | None = UNSET
    requests_per_minute: Limit | UnsetType | None = UNSET
    tokens_per_minute: Limit | UnsetType | None = UNSET
    request_burst: Limit | UnsetType | None = UNSET
    token_burst: Limit | UnsetType | None = UNSET
    max_concurrent: Limit | UnsetType | None = UNSET


class ApiKeyOut(msgspec.Struct):
    id: str
    org_id: str
    prefix: str
    name: str
    role: str
    scopes: list[str] | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    user_id: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    request_burst: int | None = None
    token_burst: int | None = None
    max_concurrent: int | None = None
    last_used_at: datetime | None = None


class ApiKeyCreated(ApiKeyOut):
    """Carries the secret: the only time it is ever shown."""

    secret: str = ""
