"""Admin API of the hourly rollups (HTTP only): recompute a range now."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from billing.common import time_range
from billing.jobs import rollup_hours
from billing.rollups.schemas import RollupRun, RollupRunOut
from control_plane.policy import Principal, require_platform_admin


class RollupController(Controller):
    path = "/rollups"
    tags = ["Admin: billing"]

    @post()
    async def run_rollups(
        self, data: JSONBody[RollupRun], admin: NamedDependency[Principal], request: Request[Any, Any, Any]
    ) -> RollupRunOut:
        """Recompute the hourly rollups of a range now (the scheduler does it hourly)."""
        require_platform_admin(admin, "run rollups")
        start, end = time_range(data.start, data.end)
        stats = await rollup_hours(request.app.state.sessionmaker, start, end)
        return RollupRunOut(
            start=stats.start,
            end=stats.end,
            rows=stats.rows,
            inserted=stats.inserted,
            updated=stats.updated,
            deleted=stats.deleted,
        )
