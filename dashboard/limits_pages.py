"""The dashboard's Limits page: an organisation's limits and budget against what it uses
(HTTP only: the numbers are billing's `limits_report`, as on the admin API's
`GET /admin/v1/organizations/{org}/limits`)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template

from billing.limits.services import limits_report
from control_plane.unit import UnitOfWork
from dashboard.services import org_names
from dashboard.web import admin_of, org_for_write, page


@get("/limits")
async def limits(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
) -> Template:
    """Organisation admins see their own organisation's (another's is a 404, as everywhere);
    platform admins any one's."""
    admin = admin_of(request)
    org_id = await org_for_write(uow, admin, org)
    found = await uow.orgs.visible(org_id, admin)
    report = await limits_report(uow.session, found, request.app.state.settings)
    return page(
        request,
        "limits.html",
        title="Limits",
        current="limits",
        report=report,
        org_id=org_id,
        orgs=await org_names(uow.session, admin),
    )
