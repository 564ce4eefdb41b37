"""Admin API of the price book (HTTP only: the rules are the services').

Every admin reads the price book; only platform admins add price versions.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from billing.common import as_utc, parse_time
from billing.models import Price
from billing.prices.schemas import GpuPriceCreate, GpuPriceOut, ModelPriceCreate, ModelPriceOut
from billing.prices.services import PriceBook
from control_plane.audit.services import record_change
from control_plane.catalog.models import Model
from control_plane.policy import Principal, require_platform_admin


def _at(value: str | None) -> datetime | None:
    return None if value is None else parse_time(value, "at")


def _model_price_out(price: Price, model: Model) -> ModelPriceOut:
    return ModelPriceOut(
        id=price.id,
        model_id=model.id,
        model=model.name,
        currency=price.currency,
        input_per_mtok=price.input_per_mtok.normalize(),
        cached_input_per_mtok=price.cached_input_per_mtok.normalize(),
        output_per_mtok=price.output_per_mtok.normalize(),
        batch_discount=price.batch_discount.normalize(),
        effective_from=as_utc(price.effective_from),
        created_at=as_utc(price.created_at),
    )


def _gpu_price_out(price: Price) -> GpuPriceOut:
    return GpuPriceOut(
        id=price.id,
        gpu_type=price.gpu_type or "",
        currency=price.currency,
        per_hour=price.gpu_hour.normalize(),
        effective_from=as_utc(price.effective_from),
        created_at=as_utc(price.created_at),
    )


class PriceController(Controller):
    path = "/prices"
    tags = ["Admin: billing"]

    @get("/models")
    async def list_model_prices(
        self,
        db_session: NamedDependency[AsyncSession],
        model: Annotated[str | None, QueryParameter(description="Model name or id.")] = None,
        at: Annotated[
            str | None, QueryParameter(description="Only the version in effect at this time (ISO 8601).")
        ] = None,
    ) -> list[ModelPriceOut]:
        """Every price version of every model (or one), oldest first; with `at`, the ones
        in effect then."""
        found = await PriceBook(db_session).model_prices(model_ref=model, at=_at(at))
        return [_model_price_out(p, m) for p, m in found]

    @post("/models")
    async def create_model_price(
        self,
        data: JSONBody[ModelPriceCreate],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> ModelPriceOut:
        """A new price version (history is never edited: usage keeps the price it had)."""
        require_platform_admin(admin, "set prices")
        price, model = await PriceBook(db_session).add_model_price(
            model_ref=data.model,
            input_per_mtok=data.input_per_mtok,
            cached_input_per_mtok=data.cached_input_per_mtok,
            output_per_mtok=data.output_per_mtok,
            currency=data.currency,
            effective_from=data.effective_from,
            batch_discount=data.batch_discount,
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return _model_price_out(price, model)

    @get("/gpus")
    async def list_gpu_prices(
        self,
        db_session: NamedDependency[AsyncSession],
        gpu_type: Annotated[str | None, QueryParameter(description="A GPU type.")] = None,
        at: Annotated[
            str | None, QueryParameter(description="Only the version in effect at this time (ISO 8601).")
        ] = None,
    ) -> list[GpuPriceOut]:
        return [
            _gpu_price_out(p) for p in await PriceBook(db_session).gpu_prices(gpu_type=gpu_type, at=_at(at))
        ]

    @post("/gpus")
    async def create_gpu_price(
        self,
        data: JSONBody[GpuPriceCreate],
        admin: NamedDependency[Principal],
        db_session: NamedDependency[AsyncSession],
    ) -> GpuPriceOut:
        require_platform_admin(admin, "set prices")
        price = await PriceBook(db_session).add_gpu_price(
            gpu_type=data.gpu_type,
            per_hour=data.per_hour,
            currency=data.currency,
            effective_from=data.effective_from,
        )
        await record_change(db_session, admin, "create", "price", price.id, org_id=None, after=price)
        return _gpu_price_out(price)
