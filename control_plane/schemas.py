"""Wire types of the admin API."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta

Name = Annotated[str, Meta(min_length=1, max_length=200)]


class OrganizationCreate(msgspec.Struct):
    name: Name


class OrganizationOut(msgspec.Struct):
    id: str
    name: str
    status: str
    created_at: datetime


class ApiKeyCreate(msgspec.Struct):
    name: Annotated[str, Meta(max_length=200)] = ""
    role: str = "member"
    scopes: list[str] | None = None
    expires_at: datetime | None = None


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


class ApiKeyCreated(ApiKeyOut):
    """Carries the secret: the only time it is ever shown."""

    secret: str = ""
