"""The plans table."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base, Timestamped, new_id


class Plan(Timestamped, Base):
    """A rate-limit tier, a monthly budget and quotas; organisations point at one."""

    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("plan"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    # How much of a minute's allowance may arrive at once (GCRA capacity); None = a whole minute.
    request_burst: Mapped[int | None]
    token_burst: Mapped[int | None]
    max_concurrent: Mapped[int | None]
    monthly_budget: Mapped[Decimal | None] = mapped_column(Numeric(14, 4))
    budget_mode: Mapped[str] = mapped_column(String(10), default="soft")  # soft: alert, hard: refuse
    # Quotas on dedicated deployments (sums of their max_replicas, and of GPUs at that size);
    # None: the platform's default (TOKENMILL_DEFAULT_MAX_*).
    max_dedicated_replicas: Mapped[int | None]
    max_gpus: Mapped[int | None]
