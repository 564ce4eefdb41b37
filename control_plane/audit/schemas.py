"""Wire types of the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


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
