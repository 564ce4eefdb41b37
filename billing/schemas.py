"""Wire types of billing's admin API. Money and quantities travel as decimal strings, so no
client ever sees a float's rounding."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

import msgspec
from msgspec import Meta

GpuType = Annotated[str, Meta(min_length=1, max_length=50)]
Currency = Annotated[str, Meta(min_length=3, max_length=3)]


class ModelPriceCreate(msgspec.Struct, forbid_unknown_fields=True):
    """A new price version of a model, per million tokens. Without `cached_input_per_mtok`,
    cached tokens cost the input price; without `effective_from`, it applies from now."""

    model: Annotated[str, Meta(min_length=1, max_length=200)]  # name or id
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cached_input_per_mtok: Decimal | None = None
    currency: Currency = "usd"
    effective_from: datetime | None = None


class ModelPriceOut(msgspec.Struct):
    id: str
    model_id: str
    model: str
    currency: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    effective_from: datetime
    created_at: datetime


class GpuPriceCreate(msgspec.Struct, forbid_unknown_fields=True):
    """A new price version of a GPU type, per GPU-hour of a dedicated deployment's workers."""

    gpu_type: GpuType
    per_hour: Decimal
    currency: Currency = "usd"
    effective_from: datetime | None = None


class GpuPriceOut(msgspec.Struct):
    id: str
    gpu_type: str
    currency: str
    per_hour: Decimal
    effective_from: datetime
    created_at: datetime


class RollupRun(msgspec.Struct, forbid_unknown_fields=True):
    """Recompute the rollups of the hours covering [from, to) (ISO dates or times, UTC)."""

    start: str = msgspec.field(name="from")
    end: str = msgspec.field(name="to")


class RollupRunOut(msgspec.Struct):
    start: datetime = msgspec.field(name="from")
    end: datetime = msgspec.field(name="to")
    rows: int
    inserted: int
    updated: int
    deleted: int


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
    meter: str  # input | cached_input | output | gpu_seconds
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
