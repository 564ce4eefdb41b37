"""The dashboard's batches page: an organisation's `/v1/batches` jobs, their files and their
cancelling (HTTP only: every read and write is the control plane's `BatchService` and
`FileService`, the same the gateway's `/v1/batches` and `/v1/files` call).

A batch is always looked up with the organisation the page is about (`org`, as on the keys
page; an organisation admin's own by default), so another organisation's batch, or its
files, is a 404 exactly like a missing one.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Stream, Template

from control_plane.batches.models import Batch
from control_plane.batches.services import CANCELLABLE, BatchService
from control_plane.unit import UnitOfWork
from dashboard.services import org_names
from dashboard.web import admin_of, attempt, form_fields, org_for_write, page
from tokenmill.errors import APIError

PAGE_SIZE = 20
# What a download link names, and the batch's column holding that file's id.
FILES = {"input": "input_file_id", "output": "output_file_id", "errors": "error_file_id"}


def _batches(request: Request[Any, Any, Any]) -> BatchService:
    return request.app.state.batches


def batch_row(batch: Batch) -> dict[str, Any]:
    """A batch as its table row shows it: lines done (completed or failed) of its total."""
    done = batch.completed + batch.failed
    return {
        "batch": batch,
        "done": done,
        "progress": done / batch.total if batch.total else None,
        "cancellable": batch.status in CANCELLABLE,
    }


@get("/batches")
async def batches(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await org_for_write(uow, admin, org)
    found = await _batches(request).page(org_id, after=after or None, limit=PAGE_SIZE)
    return page(
        request,
        "batches.html",
        title="Batches",
        current="batches",
        org_id=org_id,
        orgs=await org_names(uow.session, admin),
        rows=[batch_row(b) for b in found.batches],
        after=after or "",
        # Ids sort by creation, so the last one shown is the cursor of the next, older page.
        older=found.batches[-1].id if found.has_more and found.batches else None,
    )


@get("/batches/{batch_id:str}/download/{kind:str}")
async def batch_download(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    batch_id: FromPath[str],
    kind: FromPath[str],
    org: FromQuery[str | None] = None,
) -> Stream:
    """The batch's input, output or error file, as `GET /v1/files/{id}/content` sends it."""
    if kind not in FILES:
        raise NotFoundException()
    org_id = await org_for_write(uow, admin_of(request), org)
    service = _batches(request)
    batch = await service.get(org_id, batch_id)
    file_id = getattr(batch, FILES[kind])
    if file_id is None:  # not made (yet): a batch has an output or error file once it ends
        raise APIError(404, f"Batch {batch.id} has no {kind} file.", code="not_found")
    files = service.files
    row = await files.get(org_id, file_id)
    chunks = await files.open(row)  # opened before answering: a storage failure is still an error page
    return Stream(
        chunks,
        media_type="application/octet-stream",
        headers={
            "content-length": str(row.size),
            "content-disposition": f"attachment; filename*=UTF-8''{quote(row.filename)}",
        },
    )


@post("/batches/{batch_id:str}/cancel")
async def cancel_batch(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], batch_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)
    org_id = await org_for_write(uow, admin, fields.get("org"))
    service = _batches(request)
    before = await service.get(org_id, batch_id)  # another organisation's: a 404 page, not a message

    async def act() -> str:
        batch = await service.cancel(org_id, batch_id, actor=admin)
        if before.status in ("cancelling", "cancelled"):  # a second click, or another tab's
            return f"Batch {batch.id} is already {batch.status}."
        return f"Cancelling batch {batch.id}: none of its requests start from now on."

    return await attempt(request, uow, f"/batches?org={org_id}", act)
