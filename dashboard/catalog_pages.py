"""The dashboard's catalogue pages: models, LoRA adapters and deployments with their live
workers (HTTP only: the rules are the control plane's services')."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from control_plane.catalog.engines import format_assignments, parse_assignments
from control_plane.catalog.models import VLLM, Deployment, Model
from control_plane.catalog.schemas import DeploymentCreate, DeploymentUpdate
from control_plane.catalog.uploads import read_adapter_upload
from control_plane.policy import Principal
from control_plane.unit import UnitOfWork
from control_plane.wire import parse
from dashboard import PREFIX
from dashboard.auth import check_csrf
from dashboard.fleet import LiveWorker
from dashboard.lists import Pager, list_query
from dashboard.services import org_names
from dashboard.web import (
    admin_of,
    attempt,
    back,
    flash,
    form_fields,
    form_int,
    org_for_write,
    page,
)
from tokenmill.bodies import Form
from tokenmill.errors import APIError

# --- live workers ---------------------------------------------------------------------------


def fleet_rows(
    request: Request[Any, Any, Any], deployments: list[Any], admin: Principal
) -> tuple[list[dict[str, Any]], list[LiveWorker]]:
    """Per deployment: live workers and their load. Organisation admins see the workers of
    their own deployments; of shared ones, only how many serve."""
    workers = request.app.state.fleet.snapshot({d.id for d in deployments})
    own = {d.id for d in deployments if admin.sees(d.org_id)}
    rows = []
    for dep in deployments:
        mine = [w for w in workers if w.deployment_id == dep.id]
        live = [w for w in mine if w.live]
        rows.append(
            {
                "dep": dep,
                "live": len(live),
                "lost": len(mine) - len(live),
                "detail": dep.id in own,
                "running": sum(w.running for w in live),
                "waiting": sum(w.waiting for w in live),
                "kv": (sum(w.kv_usage for w in live) / len(live)) if live else None,
            }
        )
    return rows, [w for w in workers if w.deployment_id in own]


# --- models and adapters --------------------------------------------------------------------


@get("/models")
async def models(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    org_id = await org_for_write(uow, admin, org)
    catalogue = list(await uow.models.list_models())
    query = list_query(q, after, before)
    found = await uow.adapters.page_for_org(org_id, query)
    adapters = found.rows
    names = {m.id: m.name for m in catalogue}
    return page(
        request,
        "models.html",
        title="Models & adapters",
        current="models",
        models=catalogue,
        adapters=adapters,
        pager=Pager("/models", query, found, "adapters", {"org": org_id}),
        model_names=names,
        org_id=org_id,
        orgs=await org_names(uow.session, admin),
        max_rank=request.app.state.settings.max_lora_rank,
    )


# Not behind Litestar's CSRF middleware, which would read the whole form (files and all)
# before anything else is checked: the token is checked here, before the first file, and
# Litestar's body limit gives way to the one `read_adapter_upload` derives from the model.
@post("/adapters", request_max_body_size=None, exclude_from_csrf=True)
async def upload_adapter(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Response[Any]:
    """The two PEFT files, checked against the base model and stored (as the admin API's
    upload). A plain form post gets the page back with a message; the page's script (which
    sends it with a progress bar) asks for JSON, so it can show a refusal next to the form
    with what was typed still in it."""
    admin = admin_of(request)
    org_id = admin.org_id
    script = "application/json" in request.headers.get("accept", "")

    async def before_files(form: Form) -> None:
        nonlocal org_id
        check_csrf(request, request.headers.get("x-csrftoken") or form.text("_csrf_token"))
        # Another organisation's (or a missing) one is a 404 page, as everywhere.
        org_id = await org_for_write(uow, admin, form.text("org"))

    def refused(exc: APIError) -> Response[Any]:
        if script:
            return Response({"error": exc.message, "param": exc.param}, status_code=exc.status)
        flash(request, "error", exc.message)
        return back(f"/models?org={org_id}")

    try:
        upload = await read_adapter_upload(request, uow.adapters, before_files=before_files)
    except APIError as exc:
        if exc.status == 404 or org_id is None:
            raise
        return refused(exc)
    try:
        adapter = await uow.adapters.upload(org_id, upload.files, admin)
    except APIError as exc:
        await uow.rollback()
        return refused(exc)
    finally:
        await upload.form.close()
    message = f"Uploaded adapter {adapter.name} (rank {adapter.rank}); use it as the model name."
    flash(request, "ok", message)  # for the page either way: the script goes there next
    if script:
        return Response({"message": message, "location": f"{PREFIX}/models?org={org_id}"}, status_code=201)
    return back(f"/models?org={org_id}")


@post("/adapters/{adapter_id:str}/delete")
async def delete_adapter(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], adapter_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    service = uow.adapters
    adapter = await service.visible(adapter_id, admin)

    async def act() -> str:
        await service.delete_adapter(adapter, admin)  # its files go once that is committed
        return f"Deleted adapter {adapter.name}."

    return await attempt(request, uow, f"/models?org={adapter.org_id}", act)


# --- deployments ----------------------------------------------------------------------------


def engine_fields(fields: dict[str, str]) -> dict[str, Any]:
    """The engine part of a deployment form: `engine`, `gpus_per_replica` (empty: the
    default) and `engine_args`, one `name=value` a line, which only a vllm engine reads (with
    builtin they are left out, so switching back drops them rather than failing on them)."""
    body: dict[str, Any] = {}
    if fields.get("engine"):
        body["engine"] = fields["engine"]
    gpus = form_int(fields.get("gpus_per_replica"), "gpus_per_replica")
    if gpus is not None:
        body["gpus_per_replica"] = gpus
    if fields.get("engine") == VLLM and "engine_args" in fields:
        body["engine_args"] = parse_assignments(fields["engine_args"].splitlines())
    return body


def _engine_summary(dep: Deployment) -> str:
    n = dep.gpus_per_replica
    gpus = f", {n} GPU{'' if n == 1 else 's'} per replica" if n else ""
    return f"{dep.engine} engine{gpus}"


@get("/deployments")
async def deployments(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    q: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> Template:
    admin = admin_of(request)
    query = list_query(q, after, before)
    found = await uow.deployments.page_visible(admin, query)
    fleet, _ = fleet_rows(request, found.rows, admin)
    catalogue = await uow.models.list_models()
    return page(
        request,
        "deployments.html",
        title="Deployments",
        current="deployments",
        fleet=fleet,
        pager=Pager("/deployments", query, found, "deployments"),
        models=[m for m in catalogue],
        model_names={m.id: m.name for m in catalogue},
        orgs=await org_names(uow.session, admin),
    )


@post("/deployments")
async def create_deployment(request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork]) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)
    created: list[str] = []

    async def act() -> str:
        body = {
            "name": fields.get("name", ""),
            "model": fields.get("model", ""),
            "type": "dedicated",
            "org_id": fields.get("org") or admin.org_id,
            "gpu_type": fields.get("gpu_type") or None,
            "min_replicas": form_int(fields.get("min_replicas"), "min_replicas") or 0,
            "max_replicas": form_int(fields.get("max_replicas"), "max_replicas") or 1,
        } | engine_fields(fields)
        dep = await uow.deployments.create_deployment(parse(body, DeploymentCreate), admin)
        created.append(dep.id)
        return f"Created dedicated deployment {dep.name}; use it as the model name."

    result = await attempt(request, uow, "/deployments", act)
    return back(f"/deployments/{created[0]}") if created else result


async def _deployment_view(request: Request[Any, Any, Any], uow: UnitOfWork, dep_id: str) -> dict[str, Any]:
    admin = admin_of(request)
    dep = await uow.deployments.visible(dep_id, admin)
    rows, workers = fleet_rows(request, [dep], admin)
    model = await uow.session.get(Model, dep.model_id)
    return {
        "dep": dep,
        "row": rows[0],
        "workers": workers,
        "model": model,
        "may_change": dep.org_id is not None or admin.is_platform_admin,
        "engine_lines": format_assignments(dep.engine_args or {}),
        "org_name": (await org_names(uow.session, admin)).get(dep.org_id or "", ""),
    }


@get("/deployments/{dep_id:str}")
async def deployment(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], dep_id: FromPath[str]
) -> Template:
    view = await _deployment_view(request, uow, dep_id)
    return page(request, "deployment.html", title=view["dep"].name, current="deployments", **view)


@get("/deployments/{dep_id:str}/workers")
async def deployment_workers(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], dep_id: FromPath[str]
) -> Template:
    """The live-workers table alone, which the page's script reloads every few seconds."""
    view = await _deployment_view(request, uow, dep_id)
    return Template("_workers.html", context={"base": PREFIX, **view})


@post("/deployments/{dep_id:str}")
async def update_deployment(
    request: Request[Any, Any, Any], uow: NamedDependency[UnitOfWork], dep_id: FromPath[str]
) -> Redirect:
    admin = admin_of(request)
    fields = await form_fields(request)
    service = uow.deployments
    dep = await service.visible(dep_id, admin)

    async def act() -> str:
        change: dict[str, Any] = {}
        for name in ("min_replicas", "max_replicas"):
            value = form_int(fields.get(name), name)
            if value is not None:
                change[name] = value
        if fields.get("status") in ("active", "stopped"):
            change["status"] = fields["status"]
        change |= engine_fields(fields)
        await service.update_deployment(dep, parse(change, DeploymentUpdate), admin)
        return (
            f"Updated {dep.name}: {dep.min_replicas} to {dep.max_replicas} replicas, {dep.status}, "
            f"{_engine_summary(dep)}."
        )

    return await attempt(request, uow, f"/deployments/{dep_id}", act)
