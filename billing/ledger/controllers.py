"""Admin API of usage (HTTP only): the ledger of a range grouped by model, key or
organisation, priced (`billing/rollups/usage.py`'s `usage_by`, what the dashboard's usage
page and keys page show)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import time_range
from billing.ledger.schemas import UsageGroupOut, UsageOut
from billing.ledger.services import UsageFilter
from billing.rollups.usage import usage_by
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.services import OrganizationService
from control_plane.policy import WHILE_SUSPENDED, Principal
from tokenmill.errors import APIError


class UsageController(Controller):
    path = "/usage"
    tags = ["Admin: billing"]

    @get(opt=WHILE_SUSPENDED)
    async def usage(
        self,
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
        start: Annotated[
            str | None,
            QueryParameter(name="from", description="ISO 8601 date or time, UTC (default: month start)"),
        ] = None,
        end: Annotated[str | None, QueryParameter(name="to", description="Exclusive (default: now)")] = None,
        org: Annotated[str | None, QueryParameter(description="Organisation id or name")] = None,
        key: Annotated[str | None, QueryParameter(description="Only this API key (id or prefix)")] = None,
        model: Annotated[
            str | None, QueryParameter(description="Only this model name (as clients used it)")
        ] = None,
        group_by: Annotated[
            str, QueryParameter(description="Comma-separated: org, model, base_model, key")
        ] = "model",
    ) -> UsageOut:
        """Requests, tokens, failed requests and cost of the ledger's rows in a range, grouped;
        tokens priced at the version in effect when used (batch requests at its batch
        discount), as the rollups price them. Dedicated deployments' GPU time is in the
        rollups only. Organisation admins see their own organisation's usage; another's key
        answers 404."""
        lo, hi = time_range(start, end)
        org_id = await OrganizationService(session=db_session).scope(org, admin)
        key_id = None
        if key:
            found = await ApiKeyService(session=db_session).visible(key, admin)
            if org_id is not None and found.org_id != org_id:
                raise APIError(404, f"No API key '{key}'.", code="not_found")
            key_id = found.id
        groups = [g.strip() for g in group_by.split(",") if g.strip()]
        found_groups = await usage_by(
            db_session, lo, hi, UsageFilter(org_id=org_id, key_id=key_id, model=model or None), groups
        )
        return UsageOut(
            start=lo,
            end=hi,
            group_by=groups,
            data=[
                UsageGroupOut(
                    requests=g.requests,
                    errors=g.errors,
                    prompt_tokens=g.prompt,
                    cached_tokens=g.cached,
                    completion_tokens=g.completion,
                    cost=g.cost,
                    org_id=g.org_id,
                    model=g.model,
                    base_model=g.base_model,
                    key_id=g.key_id,
                )
                for g in found_groups
            ],
        )
