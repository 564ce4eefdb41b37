"""Admin API of exports (HTTP only): usage, refusals, rollups or invoices of a range, streamed."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from billing.exports.services import EXPORTS, export_chunks, export_query
from control_plane.orgs.services import OrganizationService
from control_plane.policy import WHILE_SUSPENDED, Principal
from tokenmill.errors import APIError


class ExportController(Controller):
    path = "/exports"
    tags = ["Admin: billing"]

    @get("/{what:str}", opt=WHILE_SUSPENDED)
    async def export(
        self,
        what: FromPath[str],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        request: Request[Any, Any, Any],
        format: Annotated[str | None, QueryParameter(description="csv (default) or json")] = None,
        start: Annotated[
            str | None,
            QueryParameter(name="from", description="ISO 8601 date or time, UTC (default: month start)"),
        ] = None,
        end: Annotated[str | None, QueryParameter(name="to", description="Exclusive (default: now)")] = None,
        org: Annotated[str | None, QueryParameter(description="Organisation id or name")] = None,
    ) -> Stream:
        """Per-request usage, refused requests per key and minute, hourly rollups or invoices
        (with their lines) of a range, as CSV or JSON, streamed from a database cursor: any
        range in bounded memory."""
        if what not in EXPORTS:
            raise APIError(404, f"No export '{what}': {', '.join(EXPORTS)}.", code="not_found")
        query = export_query(
            what, format, start, end, await OrganizationService(session=db_session).scope(org, admin)
        )
        return Stream(
            export_chunks(request.app.state.sessionmaker, query),
            media_type=query.media_type,
            headers={"content-disposition": f'attachment; filename="{query.filename}"'},
        )
