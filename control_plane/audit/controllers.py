"""Admin API of the audit log (HTTP only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from control_plane.audit.schemas import AuditEntryOut, AuditPage
from control_plane.audit.services import AuditQuery, AuditService
from control_plane.policy import Principal
from control_plane.wire import out


class AuditController(Controller):
    path = "/audit"
    tags = ["Admin: audit log"]

    @get()
    async def list_audit(
        self,
        admin: NamedDependency[Principal],
        audit: NamedDependency[AuditService],
        org_id: FromQuery[str | None] = None,
        resource_type: FromQuery[str | None] = None,
        resource_id: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        actor_key_id: FromQuery[str | None] = None,
        since: Annotated[
            datetime | None, QueryParameter(description="Entries at or after (ISO 8601).")
        ] = None,
        until: Annotated[datetime | None, QueryParameter(description="Entries before (ISO 8601).")] = None,
        after: Annotated[int | None, QueryParameter(description="`last_id` of the previous page.")] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> AuditPage:
        """Every admin change, newest first: who, what, when, before and after. Platform
        admins read all of it; organisation admins their organisation's."""
        query = AuditQuery(
            org_id=org_id,
            resource_type=resource_type,
            resource_id=resource_id,
            action=action,
            actor_key_id=actor_key_id,
            since=since,
            until=until,
            after=after,
            limit=limit,
        )
        rows, more = await audit.page(query, admin)
        data = [out(r, AuditEntryOut) for r in rows]
        return AuditPage(
            data=data,
            has_more=more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
