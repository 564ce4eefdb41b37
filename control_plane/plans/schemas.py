"""Wire types of plans."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from control_plane.wire import Body, Limit

PlanName = Annotated[str, Meta(min_length=1, max_length=100)]
# A quota may be 0 (no dedicated deployments at all); null takes the platform's default.
Quota = Annotated[int, Meta(ge=0, le=1_000_000)]


class PlanCreate(Body):
    name: PlanName
    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None
    request_burst: Limit | None = None
    token_burst: Limit | None = None
    max_concurrent: Limit | None = None
    monthly_budget: Decimal | None = None  # in the price book's currency; null: no budget
    budget_mode: Literal["soft", "hard"] = "soft"
    max_dedicated_replicas: Quota | None = None  # sum of the dedicated deployments' max_replicas
    max_gpus: Quota | None = None  # GPUs of all of them at max_replicas


class PlanUpdate(Body):
    name: PlanName | UnsetType = UNSET
    requests_per_minute: Limit | UnsetType | None = UNSET
    tokens_per_minute: Limit | UnsetType | None = UNSET
    request_burst: Limit | UnsetType | None = UNSET
    token_burst: Limit | UnsetType | None = UNSET
    max_concurrent: Limit | UnsetType | None = UNSET
    monthly_budget: Decimal | UnsetType | None = UNSET
    budget_mode: Literal["soft", "hard"] | UnsetType = UNSET
    max_dedicated_replicas: Quota | UnsetType | None = UNSET
    max_gpus: Quota | UnsetType | None = UNSET


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
    max_dedicated_replicas: int | None = None
    max_gpus: int | None = None
