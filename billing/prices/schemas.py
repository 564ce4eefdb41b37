"""Wire types of the price book's admin API. Prices travel as decimal strings, so no client
ever sees a float's rounding."""

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
    cached tokens cost the input price; without `effective_from`, it applies from now.
    `batch_discount` is the fraction taken off the token prices for requests run in a batch
    (/v1/batches): 0.5, half price, unless told otherwise."""

    model: Annotated[str, Meta(min_length=1, max_length=200)]  # name or id
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cached_input_per_mtok: Decimal | None = None
    currency: Currency = "usd"
    effective_from: datetime | None = None
    batch_discount: Decimal | None = None


class ModelPriceOut(msgspec.Struct):
    id: str
    model_id: str
    model: str
    currency: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    batch_discount: Decimal
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
