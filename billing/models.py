"""The price book and the append-only usage ledger."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base, Timestamped, new_id, utcnow

MONEY = Numeric(18, 9)


class Price(Timestamped, Base):
    """Per model: per-million-token prices; per GPU type: an hourly price. Newest effective wins."""

    __tablename__ = "prices"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("price"))
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    currency: Mapped[str] = mapped_column(String(3), default="usd")
    input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    output_per_mtok: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    gpu_hour: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    effective_from: Mapped[datetime] = mapped_column(default=utcnow)


class UsageEvent(Base):
    """One row per request. `request_id` is unique so at-least-once delivery inserts once."""

    __tablename__ = "usage_events"
    __table_args__ = (Index("ix_usage_events_org_created", "org_id", "created_at"),)

    # SQLite only auto-increments an INTEGER primary key.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
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
