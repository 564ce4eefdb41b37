"""The price book, the append-only usage ledger, refusal counts, hourly rollups and invoices."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from tokenmill.db import Base, Timestamped, new_id, utcnow

MONEY = Numeric(18, 9)  # prices and unrounded amounts
CENTS = Numeric(18, 2)  # invoice amounts, rounded half-even to the cent
QUANTITY = Numeric(24, 6)  # tokens (whole) or GPU-seconds (to the microsecond)
# SQLite only auto-increments an INTEGER primary key.
SERIAL = BigInteger().with_variant(Integer(), "sqlite")

# Tokens of requests run in a batch (/v1/batches) have meters of their own, priced at the
# price version's batch discount, so invoices and Stripe show them apart from online usage.
BATCH_METERS = ("batch_input", "batch_cached_input", "batch_output")
# Every meter of the rollups and invoice lines, in the order invoice lines list them.
METERS = ("input", "cached_input", "output", *BATCH_METERS, "gpu_seconds")


class Price(Timestamped, Base):
    """One version of a price: per model, per-million-token prices; per GPU type, an hourly
    price. Versions are only ever added: the one with the newest `effective_from` not after
    a moment is the price at that moment, so past usage keeps the price it was used at."""

    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint("model_id", "effective_from"),
        UniqueConstraint("gpu_type", "effective_from"),
        CheckConstraint("(model_id IS NULL) <> (gpu_type IS NULL)", name="one_subject"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("price"))
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    currency: Mapped[str] = mapped_column(String(3), default="usd")
    input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    output_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    gpu_hour: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    # Off the token prices for requests run in a batch (/v1/batches): 0.5 is half price.
    batch_discount: Mapped[Decimal] = mapped_column(
        Numeric(5, 4), default=Decimal("0.5"), server_default="0.5"
    )
    effective_from: Mapped[datetime] = mapped_column(default=utcnow)


class UsageEvent(Base):
    """One row per request. `request_id` is unique so at-least-once delivery inserts once."""

    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_org_created", "org_id", "created_at"),
        # Rollups and platform-wide exports read the ledger by time across organisations.
        Index("ix_usage_events_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(SERIAL, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    org_id: Mapped[str] = mapped_column(String(40))
    api_key_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(200))
    adapter: Mapped[str | None] = mapped_column(String(200))
    deployment_id: Mapped[str | None] = mapped_column(String(40))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    ttft_ms: Mapped[float | None]
    duration_ms: Mapped[float | None]
    status: Mapped[str] = mapped_column(String(20), default="ok")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The request's context, for the caller's own reconciliation (exports): OpenAI's `user`
    # (their end user; a reserved word in SQL, which SQLAlchemy quotes), their
    # X-Client-Request-Id, and the tier it ran at (default | flex). The server default keeps
    # writers that predate the tier (a consumer of the previous release mid-rollout, raw-SQL
    # fills) inserting, as default-tier requests, which is what they all were.
    user: Mapped[str | None] = mapped_column(String(256))
    client_request_id: Mapped[str | None] = mapped_column(String(512))
    service_tier: Mapped[str] = mapped_column(String(10), default="default", server_default="default")
    # The batch (/v1/batches) the request was a line of: priced at the batch discount.
    batch_id: Mapped[str | None] = mapped_column(String(64))


class Refusal(Base):
    """Requests refused before any worker ran them (401, 403, 404, 429, bad requests), per
    organisation, API key, reason (gateway/metrics.py's `REASONS`) and UTC minute.

    Gateways count refusals in memory and add their counts every few seconds (an upsert that
    adds), so a flood of 429s costs one row per key, reason and minute, never one per request.
    Only callers whose key was accepted are here: a made-up key names no organisation (those
    are in the gateway's metrics only). Like the ledger, no foreign keys: history outlives a
    deleted key or tenant.
    """

    __tablename__ = "refusals"
    __table_args__ = (Index("ix_refusals_minute", "minute"),)

    org_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)  # start of the minute, UTC
    api_key_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    reason: Mapped[str] = mapped_column(String(40), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class UsageRollup(Base):
    """What one organisation used of one meter in one UTC hour, at one price version.

    Derived from the ledger and the workers' lifetimes, never edited by hand: recomputing
    an hour replaces its rows. The key columns are never NULL ('' for "none") because a
    unique constraint treats NULLs as distinct, and the upsert relies on it. No foreign key
    to the organisation: like the ledger, billing history outlives a deleted tenant.
    """

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint("org_id", "hour", "deployment_id", "model", "adapter", "meter", "price_id"),
        Index("ix_usage_rollups_hour", "hour"),
    )

    id: Mapped[int] = mapped_column(SERIAL, primary_key=True)
    org_id: Mapped[str] = mapped_column(String(40))
    hour: Mapped[datetime]  # start of the hour, UTC
    deployment_id: Mapped[str] = mapped_column(String(40), default="")
    model: Mapped[str] = mapped_column(String(200))  # the catalogue name of the base model
    adapter: Mapped[str] = mapped_column(String(200), default="")  # adapter id, '' for none
    meter: Mapped[str] = mapped_column(String(20))  # one of METERS
    price_id: Mapped[str] = mapped_column(String(40), default="")  # '' = not charged
    quantity: Mapped[Decimal] = mapped_column(QUANTITY)  # tokens, or GPU-seconds
    # Per million tokens, or per GPU-hour; 0 when not charged (dedicated tokens, no price).
    unit_price: Mapped[Decimal] = mapped_column(MONEY)
    amount: Mapped[Decimal] = mapped_column(MONEY)  # quantity x unit price, to 1e-9
    currency: Mapped[str] = mapped_column(String(3))
    computed_at: Mapped[datetime] = mapped_column(default=utcnow)


class Invoice(Base):
    """An organisation's invoice for one calendar month (UTC) in one currency.

    `draft` invoices are rebuilt from the rollups whenever invoices are generated;
    `finalized` ones are never changed again and carry a number from one gap-free sequence.
    """

    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("org_id", "period_start", "currency"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("inv"))
    org_id: Mapped[str] = mapped_column(String(40))  # a plain id, as in the ledger
    number: Mapped[int | None] = mapped_column(unique=True)  # set when finalized
    period_start: Mapped[datetime]
    period_end: Mapped[datetime]
    currency: Mapped[str] = mapped_column(String(3))
    status: Mapped[str] = mapped_column(String(20), default="draft")  # draft | finalized
    subtotal: Mapped[Decimal] = mapped_column(CENTS, default=Decimal(0))
    total: Mapped[Decimal] = mapped_column(CENTS, default=Decimal(0))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    finalized_at: Mapped[datetime | None]

    lines: Mapped[list[InvoiceLine]] = relationship(
        order_by="InvoiceLine.position", cascade="all, delete-orphan", lazy="raise"
    )


class InvoiceLine(Base):
    """One priced meter of an invoice: quantity x unit price, rounded half-even to the cent."""

    __tablename__ = "invoice_lines"

    id: Mapped[int] = mapped_column(SERIAL, primary_key=True)
    invoice_id: Mapped[str] = mapped_column(ForeignKey("invoices.id", ondelete="CASCADE"), index=True)
    position: Mapped[int]
    description: Mapped[str] = mapped_column(String(500))
    meter: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(String(200))
    deployment_id: Mapped[str] = mapped_column(String(40), default="")
    adapter: Mapped[str] = mapped_column(String(200), default="")
    quantity: Mapped[Decimal] = mapped_column(QUANTITY)  # tokens, or GPU-seconds
    unit_price: Mapped[Decimal] = mapped_column(MONEY)  # per million tokens, or per GPU-hour
    amount: Mapped[Decimal] = mapped_column(CENTS)


# --- Stripe sync state (billing/stripe/) ------------------------------------------------


class StripeInvoiceSync(Base):
    """The Stripe mirror of one finalized local invoice (`invoices` mode).

    Written *before* Stripe is first called (`pending`), so a run that died between Stripe's
    answer and our commit knows to look for what it may have created instead of creating it
    again; `stripe_invoice_id` set once the Stripe invoice exists; `finalized` when Stripe's
    copy is complete and finalized, after which reruns skip the invoice.
    """

    __tablename__ = "stripe_invoice_syncs"

    invoice_id: Mapped[str] = mapped_column(ForeignKey("invoices.id", ondelete="CASCADE"), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(40), index=True)
    stripe_invoice_id: Mapped[str | None] = mapped_column(String(255), unique=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")  # pending | created | finalized
    # The total Stripe computed, in the currency's smallest unit: checked against ours.
    stripe_total: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finalized_at: Mapped[datetime | None]
    paid_at: Mapped[datetime | None]  # from the `invoice.paid` webhook


class StripeMeterEvent(Base):
    """One meter event sent (or about to be sent) to Stripe (`meters` mode).

    Usage per organisation, hour, model and meter; when more usage of an hour turns up
    after it was sent (late ledger events, a rollup recomputed), the difference goes as a
    further event with the next `seq`. Rows are written `pending` before the call and
    resent with the same identifier and value until Stripe accepted them, so a crash never
    changes what an identifier means.
    """

    __tablename__ = "stripe_meter_events"
    __table_args__ = (
        UniqueConstraint("org_id", "hour", "model", "meter", "seq"),
        Index("ix_stripe_meter_events_status", "status"),
    )

    identifier: Mapped[str] = mapped_column(String(100), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(40))
    hour: Mapped[datetime]  # start of the UTC hour; also the event's timestamp
    model: Mapped[str] = mapped_column(String(200))
    meter: Mapped[str] = mapped_column(String(20))
    seq: Mapped[int] = mapped_column(default=0)
    event_name: Mapped[str] = mapped_column(String(100))
    stripe_customer_id: Mapped[str] = mapped_column(String(255))
    value: Mapped[Decimal] = mapped_column(QUANTITY)
    status: Mapped[str] = mapped_column(String(10), default="pending")  # pending | sent
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None]


class StripeWebhookEvent(Base):
    """A Stripe webhook event already handled: Stripe delivers at least once."""

    __tablename__ = "stripe_webhook_events"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)  # evt_...
    type: Mapped[str] = mapped_column(String(100))
    outcome: Mapped[str] = mapped_column(String(500), default="")  # what it changed, for operators
    received_at: Mapped[datetime] = mapped_column(default=utcnow)


class StripeInvoicePayment(Base):
    """Payment state of a Stripe invoice (mirrored or Stripe's own, in `meters` mode), as the
    webhooks told it. `paid` is final: a `payment_failed` delivered after it is stale."""

    __tablename__ = "stripe_invoice_payments"

    stripe_invoice_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(10))  # failed | paid
    failed_at: Mapped[datetime | None]
    paid_at: Mapped[datetime | None]


class StripeSuspension(Base):
    """An organisation suspended because a Stripe payment failed. Only these suspensions are
    lifted by payment: one made by an admin stays until an admin lifts it."""

    __tablename__ = "stripe_suspensions"

    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), primary_key=True)
    stripe_invoice_id: Mapped[str] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
