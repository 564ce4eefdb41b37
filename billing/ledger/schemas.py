"""Wire types of the usage admin API. Money travels as decimal strings."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import msgspec


class UsageGroupOut(msgspec.Struct, omit_defaults=True):
    """One group: the fields it is grouped by, its requests and tokens (prompt includes
    cached), failed requests, and cost per currency (exact, unrounded)."""

    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: dict[str, Decimal]
    org_id: str | None = None
    model: str | None = None
    base_model: str | None = None
    key_id: str | None = None


class UsageOut(msgspec.Struct):
    start: datetime = msgspec.field(name="from")
    end: datetime = msgspec.field(name="to")
    group_by: list[str] = msgspec.field(default_factory=list)
    data: list[UsageGroupOut] = msgspec.field(default_factory=list)
