"""Admin API of the audit log (HTTP only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from control_plane.audit.schemas import AuditEntryOut, AuditPage
from control_plane.audit.services import AuditQuery, AuditService
from control_plane.paging import page_of
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
        actor_user_id: FromQuery[str | None] = None,
        actor: Annotated[
            str | None, QueryParameter(description="A user's email or id, or an API key's prefix or id.")
        ] = None,
        q: Annotated[
            str | None,
            QueryParameter(
                description="Search: action, resource type or id, or the actor's email, key prefix or name.",
                max_length=200,
            ),
        ] = None,
        since: Annotated[
            datetime | None, QueryParameter(description="Entries at or after (ISO 8601).")
        ] = None,
        until: Annotated[datetime | None, QueryParameter(description="Entries before (ISO 8601).")] = None,
        after: Annotated[int | None, QueryParameter(description="`last_id` of the previous page.")] = None,
        before: Annotated[
            int | None, QueryParameter(description="`first_id` of a page: the entries just newer than it.")
        ] = None,
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
            actor_user_id=actor_user_id,
            actor=actor,
            since=since,
            until=until,
        )
        page = page_of(
            q, limit, None if after is None else str(after), None if before is None else str(before)
        )
        found = await audit.page(query, admin, page)
        data = [out(r, AuditEntryOut) for r in found.rows]
        return AuditPage(
            data=data,
            has_more=found.has_more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
