"""Billing's admin endpoints under /admin/v1: prices, rollups, invoices, exports, usage by
model and key (priced), and an organisation's limits against its use.

Behind the control plane's admin guard (`require_admin`): platform admins see and manage
everything; organisation admins read the price book and their own organisation's invoices
and usage, and another organisation's answer 404 exactly like missing ones. Stripe's
webhook is not here: it is outside /admin, authenticated by Stripe's signature
(billing/stripe/controllers.py).
"""

from __future__ import annotations

from litestar import Router
from litestar.di import Provide

from billing.exports.controllers import ExportController
from billing.invoices.controllers import InvoiceController
from billing.ledger.controllers import UsageController
from billing.limits.controllers import LimitsController
from billing.prices.controllers import PriceController
from billing.rollups.controllers import RollupController
from control_plane.deps import provide_admin, require_admin


def billing_router() -> Router:
    """Billing's admin endpoints, behind the same guard as the control plane's (a new
    Router per app, as `admin_router`)."""
    return Router(
        path="/admin/v1",
        route_handlers=[
            PriceController,
            RollupController,
            InvoiceController,
            ExportController,
            LimitsController,
            UsageController,
        ],
        guards=[require_admin],
        dependencies={"admin": Provide(provide_admin, sync_to_thread=False)},
    )
