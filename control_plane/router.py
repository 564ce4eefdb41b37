"""The admin API under /admin/v1: every domain's controllers behind the admin guard.

Roles: a platform admin manages everything; an organisation admin manages its own
organisation's users, keys, adapters and dedicated deployments and reads the shared
catalogue (models, serverless deployments, plans); member keys are for inference only.
Another organisation's resources answer 404, exactly like missing ones, so ids cannot be
probed. The rules are the services' (control_plane/policy.py for who may do what); changes
are committed, and then announced to the gateways, by the request's unit of work.
"""

from __future__ import annotations

from litestar import Router

from control_plane.audit.controllers import AuditController
from control_plane.catalog.controllers import AdapterController, DeploymentController, ModelController
from control_plane.deps import ADMIN_DEPENDENCIES, require_admin
from control_plane.orgs.controllers import ApiKeyController, OrganizationController, UserController
from control_plane.plans.controllers import PlanController


def admin_router() -> Router:
    """Everything under /admin/v1 of the control plane (a new Router per app, so several
    apps in one process never share one). The app provides `uow` and `db_session`
    (control_plane.deps.UNIT_DEPENDENCIES)."""
    return Router(
        path="/admin/v1",
        route_handlers=[
            OrganizationController,
            UserController,
            ApiKeyController,
            ModelController,
            DeploymentController,
            AdapterController,
            PlanController,
            AuditController,
        ],
        guards=[require_admin],
        dependencies=ADMIN_DEPENDENCIES,
    )
