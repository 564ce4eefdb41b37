"""Wire types of the admin API.

Request bodies refuse unknown fields, so a typo (`request_per_minute`) is a 400 naming it
rather than a setting silently ignored. Update bodies use `UNSET` for "leave as is", so
`null` can mean "clear" (no limit, no plan, no expiry).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

Name = Annotated[str, Meta(min_length=1, max_length=200)]
# What clients send as `model` (deployments, adapters, models): no spaces or odd characters.
ModelName = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]
# Limits fit the database's 32-bit integer columns.
Limit = Annotated[int, Meta(ge=1, le=2_147_483_647)]
Role = Literal["platform_admin", "org_admin", "member"]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


# --- organisations ---------------------------------------------------------------------


class OrganizationCreate(_Body):
    name: Name
    plan_id: str | None = None


class OrganizationUpdate(_Body):
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


class UserCreate(_Body):
    email: Email
    password: Password
    role: Role = "member"


class UserUpdate(_Body):
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


class ApiKeyCreate(_Body):
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


class ApiKeyUpdate(_Body):
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


# --- models ----------------------------------------------------------------------------

ContextLength = Annotated[int, Meta(ge=1, le=16_777_216)]


class ModelCreate(_Body):
    name: ModelName
    source: Annotated[str, Meta(min_length=1, max_length=1000)]
    format: Literal["hf", "gguf"] = "hf"
    kind: Literal["generate", "embed"] = "generate"
    context_length: ContextLength = 2048


class ModelUpdate(_Body):
    source: Annotated[str, Meta(min_length=1, max_length=1000)] | UnsetType = UNSET
    format: Literal["hf", "gguf"] | UnsetType = UNSET
    context_length: ContextLength | UnsetType = UNSET


class ModelOut(msgspec.Struct):
    id: str
    name: str
    source: str
    format: str
    kind: str
    context_length: int
    created_at: datetime


# --- deployments -----------------------------------------------------------------------

GpuType = Annotated[str, Meta(min_length=1, max_length=50, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Replicas = Annotated[int, Meta(ge=0, le=1000)]
AdapterIds = Annotated[list[Annotated[str, Meta(min_length=1, max_length=40)]], Meta(max_length=100)]


Seconds = Annotated[float, Meta(gt=0, le=86_400)]


class Autoscaling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """How the autoscaler sizes a deployment between its min and max replicas; unset fields
    take the autoscaler's defaults (autoscaler/policy.py)."""

    target_concurrency: Annotated[float, Meta(gt=0, le=10_000)] | None = None  # requests per replica
    target_ttft_seconds: Seconds | None = None  # p95; above it the fleet grows
    stable_window_seconds: Seconds | None = None
    panic_window_seconds: Seconds | None = None
    scale_down_cooldown_seconds: Seconds | None = None
    scale_to_zero_grace_seconds: Seconds | None = None  # idle time before a min-0 deployment stops


class DeploymentCreate(_Body):
    name: ModelName
    model: Annotated[str, Meta(min_length=1, max_length=200)]  # id or name of a base model
    type: Literal["serverless", "dedicated"] = "dedicated"
    org_id: str | None = None  # owner of a dedicated deployment (org admins: their own)
    adapters: AdapterIds = []
    gpu_type: GpuType | None = None
    min_replicas: Replicas = 1
    max_replicas: Replicas = 1
    status: Literal["active", "stopped"] = "active"
    autoscaling: Autoscaling | None = None


class DeploymentUpdate(_Body):
    adapters: AdapterIds | UnsetType = UNSET
    gpu_type: GpuType | UnsetType | None = UNSET
    min_replicas: Replicas | UnsetType = UNSET
    max_replicas: Replicas | UnsetType = UNSET
    status: Literal["active", "stopped"] | UnsetType = UNSET
    autoscaling: Autoscaling | UnsetType = UNSET  # replaces the whole setting


class DeploymentOut(msgspec.Struct):
    id: str
    name: str
    model_id: str
    org_id: str | None
    type: str
    kind: str
    gpu_type: str | None
    min_replicas: int
    max_replicas: int
    status: str
    adapters: list[str]
    created_at: datetime
    autoscaling: Autoscaling = Autoscaling()


# --- adapters --------------------------------------------------------------------------


class AdapterOut(msgspec.Struct):
    id: str
    org_id: str
    model_id: str
    name: str
    rank: int
    target_modules: list[str] | None
    size_bytes: int | None
    sha256: str | None
    created_at: datetime


# --- plans -----------------------------------------------------------------------------

PlanName = Annotated[str, Meta(min_length=1, max_length=100)]


class PlanCreate(_Body):
    name: PlanName
    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None
    request_burst: Limit | None = None
    token_burst: Limit | None = None
    max_concurrent: Limit | None = None
    monthly_budget: Decimal | None = None  # in the price book's currency; null: no budget
    budget_mode: Literal["soft", "hard"] = "soft"


class PlanUpdate(_Body):
    name: PlanName | UnsetType = UNSET
    requests_per_minute: Limit | UnsetType | None = UNSET
    tokens_per_minute: Limit | UnsetType | None = UNSET
    request_burst: Limit | UnsetType | None = UNSET
    token_burst: Limit | UnsetType | None = UNSET
    max_concurrent: Limit | UnsetType | None = UNSET
    monthly_budget: Decimal | UnsetType | None = UNSET
    budget_mode: Literal["soft", "hard"] | UnsetType = UNSET


class PlanOut(msgspec.Struct):
    id: str
    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    request_burst: int | None
    token_burst: int | None
    max_concurrent: int | None
    monthly_budget: Decimal | None
    budget_mode: str
    created_at: datetime


# --- audit log -------------------------------------------------------------------------


class AuditEntryOut(msgspec.Struct):
    id: int
    at: datetime
    actor_key_id: str | None  # both actor ids null: the system (CLI, first start)
    actor_user_id: str | None
    org_id: str | None
    action: str
    resource_type: str
    resource_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class AuditPage(msgspec.Struct):
    """Newest first. Pass `last_id` as `after` for the next page while `has_more`."""

    data: list[AuditEntryOut]
    has_more: bool
    first_id: int | None
    last_id: int | None
    object: str = "list"
