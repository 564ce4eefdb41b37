"""Wire types of the invoices' admin API. Money and quantities travel as decimal strings, so
no client ever sees a float's rounding."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

import msgspec
from msgspec import Meta


class InvoiceGenerate(msgspec.Struct, forbid_unknown_fields=True):
    month: Annotated[str, Meta(min_length=1, max_length=10)]  # YYYY-MM


class InvoiceGenerateOut(msgspec.Struct):
    month: str
    created: list[str]
    updated: list[str]
    unchanged: list[str]
    deleted: list[str]
    finalized: list[str]


class InvoiceLineOut(msgspec.Struct):
    position: int
    description: str
    meter: str  # input | cached_input | output | gpu_seconds; batch_ + a token meter for batches
    model: str
    deployment_id: str | None
    adapter: str | None
    quantity: Decimal  # tokens, or GPU-seconds
    unit: str  # what unit_price is per: "1M tokens" or "GPU-hour"
    unit_price: Decimal
    amount: Decimal  # quantity x unit price, rounded half-even to the cent


class InvoiceOut(msgspec.Struct, omit_defaults=True):
    id: str
    org_id: str
    number: str | None  # TM-000001, once finalized
    status: str  # draft | finalized
    period_start: datetime
    period_end: datetime
    currency: str
    subtotal: Decimal
    total: Decimal
    created_at: datetime
    updated_at: datetime
    finalized_at: datetime | None
    lines: list[InvoiceLineOut] | None = None  # left out of listings
