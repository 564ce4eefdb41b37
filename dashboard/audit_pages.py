"""The dashboard's audit-log page: every admin change, newest first, filtered and searched
(HTTP only: the entries, their scope and who made them are the control plane's
`AuditService`, the same `GET /admin/v1/audit` reads).

Organisation admins see their own organisation's entries only (naming another organisation
is a 404 page, as on the admin API); who made a change outside their organisation (a
platform admin) is named by role, not by email. The entries' before/after snapshots were
written without secrets (control_plane/audit/services.py `snapshot`), so they are shown as
they are.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template

from billing.common import parse_time
from control_plane.audit.models import AuditEntry
from control_plane.audit.services import ACTIONS, RESOURCE_TYPES, AuditQuery
from control_plane.paging import Page
from control_plane.unit import UnitOfWork
from dashboard.lists import Pager, list_query
from dashboard.services import org_names
from dashboard.web import admin_of, page
from tokenmill.errors import APIError

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
# Where a resource of each type has a page of its own.
_LINKS = {"organization": "/orgs/{}", "deployment": "/deployments/{}", "invoice": "/invoices/{}"}


def _time_range(start: str | None, end: str | None) -> tuple[datetime | None, datetime | None]:
    """[from, to) of the date inputs: `to` is a day included whole (or an exact time)."""
    since = parse_time(start, "from") if start else None
    until = None
    if end:
        until = parse_time(end, "to")
        if _DAY.fullmatch(end.strip()):
            until += timedelta(days=1)
    if since is not None and until is not None and until <= since:
        raise APIError(400, "'to' must not be before 'from'.", param="to")
    return since, until


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode()


def changes(entry: AuditEntry) -> list[dict[str, Any]]:
    """The fields of an entry's before and after snapshots side by side, changed ones first
    marked (a creation has only an after, a deletion only a before)."""
    before, after = entry.before or {}, entry.after or {}
    rows = []
    for name in [*before, *(k for k in after if k not in before)]:
        old, new = before.get(name), after.get(name)
        rows.append(
            {
                "field": name,
                "before": _shown(old) if name in before else "",
                "after": _shown(new) if name in after else "",
                "changed": entry.before is not None and entry.after is not None and old != new,
            }
        )
    return rows


@get("/audit")
async def audit_log(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    resource_type: FromQuery[str | None] = None,
    action: FromQuery[str | None] = None,
    actor: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    start = request.query_params.get("from")  # a Python keyword, so not a parameter
    # Another organisation (or a missing one) is a 404 page, before anything is read.
    org_id = await uow.orgs.scope(org or None, admin)
    params = {
        "org": org or "",
        "resource_type": resource_type or "",
        "action": action or "",
        "actor": actor or "",
        "from": start or "",
        "to": to or "",
    }
    query = list_query(q, after, before)
    error = None
    try:
        since, until = _time_range(start, to)
        found = await uow.audit.page(
            AuditQuery(
                org_id=org_id,
                resource_type=resource_type or None,
                action=action or None,
                actor=actor or None,
                since=since,
                until=until,
            ),
            admin,
            query,
        )
    except APIError as exc:
        if exc.status == 404:
            raise
        # A bad filter: the page again, filters as typed, the message next to them.
        error, found = exc.message, Page([])
    actors = await uow.audit.actors(found.rows, admin)
    names = await org_names(uow.session, admin)
    entries = [
        {
            "entry": e,
            "actor": actors[e.id],
            "org": names.get(e.org_id or "", e.org_id) if e.org_id else "platform",
            "link": _LINKS[e.resource_type].format(e.resource_id) if e.resource_type in _LINKS else None,
            "changes": changes(e),
        }
        for e in found.rows
    ]
    response = page(
        request,
        "audit.html",
        title="Audit log",
        current="audit",
        entries=entries,
        pager=Pager("/audit", query, found, "entries", params),
        params=params,
        orgs=names,
        resource_types=RESOURCE_TYPES,
        actions=ACTIONS,
        error=error,
    )
    if error is not None:
        response.status_code = 400
    return response
