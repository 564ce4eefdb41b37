"""The dashboard's usage pages (HTTP only): the usage explorer's charts and tables, and its
downloads, which are billing's exports (billing/exports/services.py), the same files as the
admin API's `GET /admin/v1/exports/...`. The numbers come from billing's services;
dashboard/services.py shapes the charts' windows and stacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Stream, Template

from billing.exports.services import ExportQuery, export_chunks
from control_plane.policy import (
    WHILE_SUSPENDED,
    Principal,
)
from control_plane.unit import UnitOfWork
from dashboard import charts
from dashboard.filters import money
from dashboard.services import (
    KEY_CHOICES,
    Series,
    Stacks,
    UsageFilter,
    key_choices,
    key_labels,
    model_stacks,
    org_names,
    usage_breakdown,
    usage_series,
    window,
)
from dashboard.web import (
    admin_of,
    page,
)
from tokenmill.errors import APIError

# --- usage charts ---------------------------------------------------------------------------


def _spend_axis(value: float) -> str:
    # Axis labels stay short (the chart's left margin fits the longest): 1.2k, not 1,234.00.
    return charts.compact(value) if abs(value) >= 1000 else money(value, None)


def usage_charts(series: Series, prefix: str, stacks: Stacks | None = None) -> list[dict[str, Any]]:
    """The charts of a usage series: requests and tokens (stacked by model when `stacks` has
    models), spend and error rate. Each has a `legend` of (name, class) when stacked."""
    hourly = series.window.hourly
    starts = [b.at for b in series.buckets]

    def points(value: Callable[[Any], float]) -> list[charts.Point]:
        return [charts.Point(b.at, value(b)) for b in series.buckets]

    out: list[dict[str, Any]] = []
    counts = (
        ("requests", "Requests", lambda b: b.requests, stacks.requests if stacks else None),
        ("tokens", "Tokens (prompt + completion)", lambda b: b.tokens, stacks.tokens if stacks else None),
    )
    for key, title, value, stacked in counts:
        chart_id = f"{prefix}-{key}"
        if stacks and stacks.names and stacked is not None:
            layers = [charts.Layer(name, [b[j] for b in stacked]) for j, name in enumerate(stacks.names)]
            title = f"{title} by model"
            svg = charts.render_stacked(starts, layers, chart_id=chart_id, title=title, hourly=hourly)
            legend = [(name, f"s{j % charts.SERIES_CLASSES}") for j, name in enumerate(stacks.names)]
        else:
            svg = charts.render(points(value), chart_id=chart_id, title=title, hourly=hourly, integer=True)
            legend = []
        out.append({"id": chart_id, "title": title, "svg": svg, "legend": legend})
    source = "from hourly rollups" if series.spend_from == "rollups" else "priced from the ledger"
    spend_title = f"Spend ({series.currency.upper()}, {source})"
    out.append(
        {
            "id": f"{prefix}-spend",
            "title": spend_title,
            "svg": charts.render(
                points(lambda b: float(b.spend)),
                chart_id=f"{prefix}-spend",
                title=spend_title,
                hourly=hourly,
                fmt=lambda v: money(v, None),
                axis_fmt=_spend_axis,
            ),
            "legend": [],
        }
    )
    out.append(
        {
            "id": f"{prefix}-errors",
            "title": "Error rate",
            "svg": charts.render(
                points(lambda b: b.error_rate),
                chart_id=f"{prefix}-errors",
                title="Error rate",
                hourly=hourly,
                kind="line",
                fmt=lambda v: f"{v * 100:.1f}%",
                axis_fmt=lambda v: f"{v * 100:g}%",
            ),
            "legend": [],
        }
    )
    return out


# --- usage ----------------------------------------------------------------------------------


async def _usage_filter(
    uow: UnitOfWork, admin: Principal, org: str | None, key: str | None, model: str | None
) -> tuple[UsageFilter, Any]:
    org_id = await uow.orgs.scope(org, admin)
    found = None
    if key:
        found = await uow.keys.visible(key, admin)
        if org_id is not None and found.org_id != org_id:
            raise APIError(404, f"No API key '{key}'.", code="not_found")
    if found is not None:
        # A key is one organisation's: filtering by it too reads the ledger's (org, time) index.
        org_id = found.org_id
    return UsageFilter(org_id=org_id, key_id=found.id if found else None, model=model or None), found


@get("/usage", opt=WHILE_SUSPENDED)
async def usage(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    range: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Template:
    """Totals, charts (stacked by model), the table by hour or day and the breakdown by model
    and key of a filter. A bad date range is this page again, with the message next to the
    form and what was typed kept (400)."""
    admin = admin_of(request)
    start = request.query_params.get("from")  # a Python keyword, so not a parameter
    filt, _ = await _usage_filter(uow, admin, org, key, model)
    # What was typed, kept as typed when it is wrong; the window's own dates otherwise.
    params = {"org": org or "", "key": key or "", "model": model or "", "from": start or "", "to": to or ""}
    error: APIError | None = None
    try:
        win = window(range or ("7d" if not (start or to) else None), start, to)
    except APIError as exc:
        win, error = None, exc
    names = {d.name for d in await uow.deployments.list_visible(admin)}
    if filt.org_id:
        names |= {a.name for a in await uow.adapters.list_for_org(filt.org_id)}
    context: dict[str, Any] = {"series": None, "breakdown": None, "charts": [], "key_labels": {}}
    used: list[str] = []  # keys with usage in the range, most used first
    if win is not None:
        params |= {"from": win.from_date, "to": win.to_date}
        series = await usage_series(uow.session, win, filt, detailed=True)
        breakdown = usage_breakdown(series)
        names |= {g.model for g in breakdown.by_model if g.model}
        used = [g.key_id for g in breakdown.by_key if g.key_id]
        context = {
            "series": series,
            "breakdown": breakdown,
            "charts": [
                c for c in usage_charts(series, "usage", model_stacks(series)) if c["id"] != "usage-errors"
            ],
        }
    choices = []
    if filt.org_id:
        choices = await key_choices(
            uow.session, filt.org_id, [*used, *([filt.key_id] if filt.key_id else [])]
        )
    if context["breakdown"] is not None:
        context["key_labels"] = await key_labels(uow.session, choices, context["breakdown"].by_key)
    if filt.model:
        names.add(filt.model)  # a model with nothing in the range stays selected
    response = page(
        request,
        "usage.html",
        title="Usage",
        current="usage",
        win=win,
        filt=filt,
        error=error,
        orgs=await org_names(uow.session, admin),
        key_choices=choices,
        more_keys=len(choices) >= KEY_CHOICES,
        model_names=sorted(names),
        params=params,
        csv_query=urlencode({k: v for k, v in params.items() if v}),
        # The breakdown's rows link to the same page filtered by their model or key.
        links={
            "model": _query(params, "model"),
            "key": _query(params, "key", "org"),
        },
        **context,
    )
    if error is not None:
        response.status_code = error.status
    return response


def _query(params: dict[str, str], *without: str) -> str:
    """The filter as a query string without some parameters, ready for one more (`...&`)."""
    kept = urlencode({k: v for k, v in params.items() if v and k not in without})
    return f"{kept}&" if kept else ""


@get("/usage.csv", opt=WHILE_SUSPENDED)
async def usage_export(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Stream:
    """Every ledger row of the filter, as the admin API's usage export writes them."""
    return await _export(request, uow, "usage", org, key, model, to)


@get("/refusals.csv", opt=WHILE_SUSPENDED)
async def refusals_export(
    request: Request[Any, Any, Any],
    uow: NamedDependency[UnitOfWork],
    org: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    to: FromQuery[str | None] = None,
) -> Stream:
    """The refused requests of the filter per key, reason and minute, as the admin API's
    refusals export writes them (per key: no model filter)."""
    return await _export(request, uow, "refusals", org, key, None, to)


async def _export(
    request: Request[Any, Any, Any],
    uow: UnitOfWork,
    what: str,
    org: str | None,
    key: str | None,
    model: str | None,
    to: str | None,
) -> Stream:
    admin = admin_of(request)
    start = request.query_params.get("from")  # a Python keyword, so not a parameter
    filt, _ = await _usage_filter(uow, admin, org, key, model)
    win = window("7d" if not (start or to) else None, start, to)
    query = ExportQuery(
        what, "csv", win.start, win.end, org_id=filt.org_id, key_id=filt.key_id, model=filt.model
    )
    name = f"{what}-{filt.org_id or 'all'}-{win.from_date}-{win.to_date}.csv"
    return Stream(
        export_chunks(request.app.state.sessionmaker, query),
        media_type=query.media_type,
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )
