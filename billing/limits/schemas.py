"""Wire types of `GET /admin/v1/organizations/{org}/limits`. Money travels as decimal strings."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import msgspec


class LimitsOut(msgspec.Struct):
    """Limits in force (null: no limit). A rate's burst is how much of a minute's allowance
    may arrive at once."""

    requests_per_minute: int | None
    request_burst: int | None
    tokens_per_minute: int | None
    token_burst: int | None
    max_concurrent: int | None


class UseOut(msgspec.Struct):
    requests: int
    tokens: int  # prompt + completion


class KeyLimitsOut(msgspec.Struct):
    id: str
    prefix: str
    name: str
    limits: LimitsOut
    last_minute: UseOut


class OrgLimitsOut(msgspec.Struct):
    org_id: str
    plan_id: str | None  # null: the platform's default tier
    plan_name: str | None
    limits: LimitsOut
    monthly_budget: Decimal | None
    budget_mode: str | None  # soft (alert) | hard (refuse); null without a budget
    month_start: datetime
    spent_this_month: Decimal  # exact, as the gateway's budget counter is seeded
    last_minute_from: datetime
    last_minute_to: datetime
    last_minute: UseOut  # from the ledger: ended requests (running and refused ones are not in it)
    keys: list[KeyLimitsOut]  # live keys with limits of their own, which apply on top
