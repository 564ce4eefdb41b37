"""The price book: versions of per-model token prices and per-GPU-type hourly prices.

Versions are only ever added, never edited: the one with the newest `effective_from` not
after a moment is the price at that moment, so usage keeps the price it was used at.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from billing.common import BILLIONTH, MILLION, as_utc
from billing.models import BATCH_METERS, Invoice, Price
from control_plane.catalog.models import Model
from tokenmill.db import utcnow
from tokenmill.errors import APIError

# The most a price may be: what its column (Numeric(18, 9)) holds.
MAX_PRICE = Decimal(10) ** 9
CURRENCY = re.compile(r"^[a-z]{3}$")
# What a price version takes off the token prices of batch requests unless told otherwise
# (the column's default): half price, as OpenAI's Batch API.
DEFAULT_BATCH_DISCOUNT = Decimal("0.5")
# The batch discount's column is Numeric(5, 4).
DISCOUNT_PLACES = Decimal("0.0001")


def batch_price(price: Decimal, discount: Decimal) -> Decimal:
    """A token price less the batch discount, rounded half-even to the precision of prices:
    the unit price an invoice line shows, so its amount is its quantity times that price
    (and the budget counter charges what the invoice will)."""
    return (price * (1 - discount)).quantize(BILLIONTH, ROUND_HALF_EVEN)


@dataclass(slots=True, frozen=True)
class Rates:
    """Per-million-token prices of one model, and the fraction taken off them for requests
    run in a batch."""

    input: Decimal = Decimal(0)
    cached_input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    currency: str = "usd"
    batch_discount: Decimal = DEFAULT_BATCH_DISCOUNT

    def prices(self, *, batch: bool = False) -> tuple[Decimal, Decimal, Decimal]:
        """Input, cached input and output prices; for a batch request, discounted."""
        if not batch:
            return self.input, self.cached_input, self.output
        d = self.batch_discount
        return batch_price(self.input, d), batch_price(self.cached_input, d), batch_price(self.output, d)

    def cost(self, prompt: int, cached: int, completion: int, *, batch: bool = False) -> Decimal:
        """Exact cost (not rounded: rounding happens once per invoice line)."""
        p_in, p_cached, p_out = self.prices(batch=batch)
        return ((prompt - cached) * p_in + cached * p_cached + completion * p_out) / MILLION

    def worst_case(self, prompt: int, max_completion: int, *, batch: bool = False) -> Decimal:
        """The most a request can cost: every allowed token generated, each prompt token at
        the dearer of the cached and uncached price."""
        p_in, p_cached, p_out = self.prices(batch=batch)
        return (prompt * max(p_in, p_cached) + max_completion * p_out) / MILLION


FREE = Rates()


async def price_at(
    session: AsyncSession, *, model_id: str | None = None, gpu_type: str | None = None, at: datetime
) -> Price | None:
    """The version of a model's (or GPU type's) price in effect at `at`: the newest one
    whose `effective_from` is not after it."""
    subject = Price.model_id == model_id if model_id is not None else Price.gpu_type == gpu_type
    return await session.scalar(
        select(Price)
        .where(subject, Price.effective_from <= at)
        .order_by(Price.effective_from.desc())
        .limit(1)
    )


async def model_rates(session: AsyncSession, model_id: str, at: datetime | None = None) -> Rates:
    """The price of a model in effect at `at` (default now)."""
    price = await price_at(session, model_id=model_id, at=at or utcnow())
    if price is None:
        return FREE
    return Rates(
        price.input_per_mtok,
        price.cached_input_per_mtok,
        price.output_per_mtok,
        price.currency,
        price.batch_discount,
    )


def meter_price(price: Price | None, meter: str) -> Decimal:
    """What one unit of `meter` costs at a price version (per million tokens or per
    GPU-hour); nothing without a price. Batch tokens cost the token price less the
    version's batch discount."""
    if price is None:
        return Decimal(0)
    if meter in BATCH_METERS:
        return batch_price(meter_price(price, meter.removeprefix("batch_")), price.batch_discount)
    return {
        "input": price.input_per_mtok,
        "cached_input": price.cached_input_per_mtok,
        "output": price.output_per_mtok,
        "gpu_seconds": price.gpu_hour,
    }[meter]


# --- the ledger's tokens, priced -----------------------------------------------------------------------

ONLINE_METERS = ("input", "cached_input", "output")


def token_quantities(
    prompt: int, cached: int, completion: int, *, batch: bool
) -> tuple[tuple[str, int], ...]:
    """The meters tokens are billed on: input = prompt − cached (cached tokens are billed on
    their own meter), output; a batch request's on the batch meters."""
    meters = BATCH_METERS if batch else ONLINE_METERS
    return tuple(zip(meters, (prompt - cached, cached, completion), strict=True))


def token_units(price: Price | None, *, batch: bool) -> tuple[Decimal, Decimal, Decimal]:
    """A price version's unit prices (per 1M tokens) of the input, cached input and output
    meters, or of the batch meters (discounted); nothing without a version."""
    if price is None:
        return Decimal(0), Decimal(0), Decimal(0)
    meters = BATCH_METERS if batch else ONLINE_METERS
    return meter_price(price, meters[0]), meter_price(price, meters[1]), meter_price(price, meters[2])


def units_cost(units: tuple[Decimal, Decimal, Decimal], prompt: int, cached: int, completion: int) -> Decimal:
    """Tokens at unit prices (`token_units`), exactly (unrounded): prompt − cached at the
    input price, cached at the cached-input price, output at the output price; what a rollup
    row's amount is before its rounding to 10^-9."""
    return ((prompt - cached) * units[0] + cached * units[1] + completion * units[2]) / MILLION


def token_cost(price: Price | None, prompt: int, cached: int, completion: int, *, batch: bool) -> Decimal:
    """What tokens cost at a price version, exactly (unrounded). No price version: nothing."""
    return units_cost(token_units(price, batch=batch), prompt, cached, completion)


def charged_model(model_id: str | None, deployment_type: str | None) -> str | None:
    """The model whose price a request's tokens are charged at: its deployment's base model.
    None (free) for a dedicated deployment, paid by the GPU-hour (its tokens are metered,
    not charged), or a request no deployment ran."""
    return model_id if model_id is not None and deployment_type != "dedicated" else None


async def charged_price(
    session: AsyncSession,
    prices: dict[tuple[str, datetime], Price | None],
    model_id: str | None,
    deployment_type: str | None,
    moment: datetime,
) -> Price | None:
    """The version tokens of a stretch between price changes are charged at (`moment`: the
    stretch's start), looked up once per model and stretch (`prices` remembers)."""
    charged = charged_model(model_id, deployment_type)
    if charged is None:
        return None
    if (charged, moment) not in prices:
        prices[charged, moment] = await price_at(session, model_id=charged, at=moment)
    return prices[charged, moment]


class PriceHistory:
    """Every version of the models' prices, to price ledger rows one at a time (the usage
    export) as the rollups and `usage_by_bucket` price them in groups: at the version in
    effect when used."""

    def __init__(self, versions: Sequence[Price]) -> None:
        self._versions: dict[str, tuple[list[datetime], list[Price]]] = {}
        for price in sorted(versions, key=lambda p: as_utc(p.effective_from)):
            starts, found = self._versions.setdefault(price.model_id or "", ([], []))
            starts.append(as_utc(price.effective_from))
            found.append(price)

    @classmethod
    async def load(cls, session: AsyncSession) -> PriceHistory:
        return cls(list(await session.scalars(select(Price).where(Price.model_id.is_not(None)))))

    def at(self, model_id: str | None, deployment_type: str | None, at: datetime) -> Price | None:
        """The version a request's tokens are charged at (None: not charged)."""
        charged = charged_model(model_id, deployment_type)
        if charged is None or charged not in self._versions:
            return None
        starts, found = self._versions[charged]
        i = bisect_right(starts, as_utc(at))
        return found[i - 1] if i else None


def _check_price(value: Decimal, param: str) -> Decimal:
    try:
        ok = value.is_finite() and 0 <= value < MAX_PRICE and value == value.quantize(BILLIONTH)
    except InvalidOperation:
        ok = False
    if not ok:
        raise APIError(
            400, f"{param} must be a non-negative amount below 10^9 with at most 9 decimals.", param=param
        )
    return value.copy_abs()  # "-0" passes the checks, and is stored and shown as 0


def _check_discount(value: Decimal) -> Decimal:
    try:
        ok = value.is_finite() and 0 <= value <= 1 and value == value.quantize(DISCOUNT_PLACES)
    except InvalidOperation:
        ok = False
    if not ok:
        raise APIError(
            400,
            "batch_discount must be a fraction between 0 and 1 (0.5 is half price) with at most 4 decimals.",
            param="batch_discount",
        )
    return value.copy_abs()


def _check_currency(value: str) -> str:
    currency = value.strip().lower()
    if not CURRENCY.match(currency):
        raise APIError(400, "currency must be a three-letter ISO 4217 code, e.g. usd.", param="currency")
    return currency


class PriceBook:
    """Adds and reads price versions; never edits one in place."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def _model(self, ref: str) -> Model:
        model = await self.session.scalar(select(Model).where(or_(Model.id == ref, Model.name == ref)))
        if model is None:
            raise APIError(400, f"No model '{ref}' in the catalogue.", param="model")
        return model

    async def _check_effective(self, subject: ColumnElement[bool], effective_from: datetime) -> None:
        # A version starting inside an invoiced period would reprice usage that is already on
        # a finalized (immutable) invoice: rollups and invoices would disagree for ever.
        closed = await self.session.scalar(
            select(func.max(Invoice.period_end)).where(Invoice.status == "finalized")
        )
        if closed is not None and effective_from < as_utc(closed):
            raise APIError(
                409,
                f"effective_from must not be before {as_utc(closed).isoformat()}: usage before it "
                "is on finalized invoices.",
                param="effective_from",
            )
        clash = await self.session.scalar(
            select(Price.id).where(subject, Price.effective_from == effective_from)
        )
        if clash is not None:
            raise APIError(
                409,
                f"A price version effective from {effective_from.isoformat()} already exists "
                f"({clash}); add one with a later effective_from instead.",
                param="effective_from",
            )

    async def add_model_price(
        self,
        *,
        model_ref: str,
        input_per_mtok: Decimal,
        output_per_mtok: Decimal,
        cached_input_per_mtok: Decimal | None = None,
        currency: str = "usd",
        effective_from: datetime | None = None,
        batch_discount: Decimal | None = None,
    ) -> tuple[Price, Model]:
        """A new price version of a model; without a cached-input price, cached tokens cost
        as much as uncached ones. `batch_discount` is the fraction taken off its token
        prices for requests run in a batch; half by default."""
        model = await self._model(model_ref)
        when = as_utc(effective_from) if effective_from else utcnow()
        price = Price(
            model_id=model.id,
            currency=_check_currency(currency),
            input_per_mtok=_check_price(input_per_mtok, "input_per_mtok"),
            cached_input_per_mtok=_check_price(
                input_per_mtok if cached_input_per_mtok is None else cached_input_per_mtok,
                "cached_input_per_mtok",
            ),
            output_per_mtok=_check_price(output_per_mtok, "output_per_mtok"),
            batch_discount=_check_discount(
                DEFAULT_BATCH_DISCOUNT if batch_discount is None else batch_discount
            ),
            effective_from=when,
        )
        await self._check_effective(Price.model_id == model.id, when)
        self.session.add(price)
        await self.session.flush()
        return price, model

    async def add_gpu_price(
        self,
        *,
        gpu_type: str,
        per_hour: Decimal,
        currency: str = "usd",
        effective_from: datetime | None = None,
    ) -> Price:
        gpu = gpu_type.strip()
        if not gpu or len(gpu) > 50:
            raise APIError(400, "gpu_type must be 1 to 50 characters.", param="gpu_type")
        when = as_utc(effective_from) if effective_from else utcnow()
        price = Price(
            gpu_type=gpu,
            currency=_check_currency(currency),
            gpu_hour=_check_price(per_hour, "per_hour"),
            effective_from=when,
        )
        await self._check_effective(Price.gpu_type == gpu, when)
        self.session.add(price)
        await self.session.flush()
        return price

    async def model_prices(
        self, *, model_ref: str | None = None, at: datetime | None = None
    ) -> list[tuple[Price, Model]]:
        """Every version (oldest first per model), or with `at` the one in effect then."""
        stmt = select(Price, Model).join(Model, Model.id == Price.model_id)
        if model_ref is not None:
            stmt = stmt.where(Price.model_id == (await self._model(model_ref)).id)
        if at is not None:
            stmt = stmt.where(Price.effective_from <= at)
        found = await self.session.execute(stmt.order_by(Model.name, Price.effective_from))
        rows = [(p, m) for p, m in found]
        if at is not None:
            rows = list({m.id: (p, m) for p, m in rows}.values())  # the last version of each wins
        return rows

    async def gpu_prices(self, *, gpu_type: str | None = None, at: datetime | None = None) -> list[Price]:
        stmt = select(Price).where(Price.gpu_type.is_not(None))
        if gpu_type is not None:
            stmt = stmt.where(Price.gpu_type == gpu_type)
        if at is not None:
            stmt = stmt.where(Price.effective_from <= at)
        rows = list(await self.session.scalars(stmt.order_by(Price.gpu_type, Price.effective_from)))
        if at is not None:
            rows = list({p.gpu_type: p for p in rows}.values())
        return rows
