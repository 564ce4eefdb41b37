"""Tables of tenants and the catalogue. Read by the gateway (keys, deployments) and billing."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, Numeric, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from tokenmill.db import Base, Timestamped, new_id, utcnow

ROLES = ("platform_admin", "org_admin", "member")


class Plan(Timestamped, Base):
    """A rate-limit tier and a monthly budget; organisations point at one."""

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


class Organization(Timestamped, Base):
    __tablename__ = "organizations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("org"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    plan_id: Mapped[str | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"))
    # Mixed into every block hash of this organisation's prompts so tenants never share cache.
    cache_salt: Mapped[str] = mapped_column(String(64), default=lambda: new_id("salt"))
    status: Mapped[str] = mapped_column(String(20), default="active")  # active | suspended
    billing_mode: Mapped[str] = mapped_column(String(20), default="none")  # none | invoices | meters
    stripe_customer_id: Mapped[str | None] = mapped_column(String(100))

    plan: Mapped[Plan | None] = relationship(lazy="raise")


class User(Timestamped, Base):
    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("user"))
    org_id: Mapped[str | None] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    email: Mapped[str] = mapped_column(String(320), unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20), default="member")
    disabled: Mapped[bool] = mapped_column(default=False)


class ApiKey(Timestamped, Base):
    """Only `prefix` (for lookup) and a keyed hash of the whole key are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[str | None] = mapped_column(ForeignKey("users.id", ondelete="SET NULL"))
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    hash: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(20), default="member")
    scopes: Mapped[list[str] | None] = mapped_column(JSON)  # allowed model names; None = all
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    request_burst: Mapped[int | None]
    token_burst: Mapped[int | None]
    max_concurrent: Mapped[int | None]
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class Model(Timestamped, Base):
    """A base model in the catalogue."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("model"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(1000))  # path, storage URI or bundled:<name>
    format: Mapped[str] = mapped_column(String(20), default="hf")  # hf | gguf
    kind: Mapped[str] = mapped_column(String(20), default="generate")  # generate | embed
    context_length: Mapped[int] = mapped_column(default=2048)


class Adapter(Timestamped, Base):
    """A LoRA adapter, owned by one organisation, on one base model."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("adapter"))
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(1000))  # full address, e.g. s3://bucket/prefix/adapters/...
    rank: Mapped[int] = mapped_column(default=8)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON)
    # Directory-like key in the storage (tokenmill.storage) holding adapter_config.json and
    # adapter_model.safetensors; a worker with the same storage settings fetches from there.
    storage_key: Mapped[str | None] = mapped_column(String(500))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)  # both files together
    sha256: Mapped[str | None] = mapped_column(String(64))  # of adapter_model.safetensors


class Deployment(Timestamped, Base):
    """What serves a model: the shared serverless deployment, or a dedicated one owned by an org."""

    __tablename__ = "deployments"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("dep"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    org_id: Mapped[str | None] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(20), default="generate")  # generate | embed
    type: Mapped[str] = mapped_column(String(20), default="serverless")  # serverless | dedicated
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    min_replicas: Mapped[int] = mapped_column(default=1)
    max_replicas: Mapped[int] = mapped_column(default=1)
    status: Mapped[str] = mapped_column(String(20), default="active")
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    model: Mapped[Model] = relationship(lazy="raise")


class Worker(Base):
    """One worker's lifetime: dedicated deployments are billed on these."""

    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_deployment_started", "deployment_id", "started_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    deployment_id: Mapped[str | None] = mapped_column(ForeignKey("deployments.id", ondelete="SET NULL"))
    address: Mapped[str] = mapped_column(String(300))
    model: Mapped[str] = mapped_column(String(200))
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    status: Mapped[str] = mapped_column(String(20), default="running")  # running | stopped | lost
    started_at: Mapped[datetime]
    last_seen_at: Mapped[datetime | None]
    stopped_at: Mapped[datetime | None]


class AuditEntry(Base):
    """One admin change: who, what, when, the resource before and after (secret-free
    snapshots). Written in the same transaction as the change itself, so there is never a
    change without its entry, nor an entry for a change that rolled back."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_org_at", "org_id", "at"),
        Index("ix_audit_log_resource", "resource_type", "resource_id"),
    )

    # An increasing integer: the natural cursor of a newest-first listing.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    # Plain ids, not foreign keys: an entry outlives the key, user or organisation it names.
    # Both None: the system (the CLI's admin commands, the first start's bootstrap).
    actor_key_id: Mapped[str | None] = mapped_column(String(40))
    actor_user_id: Mapped[str | None] = mapped_column(String(40))
    org_id: Mapped[str | None] = mapped_column(String(40))  # None: platform-wide (models, plans)
    action: Mapped[str] = mapped_column(String(40))
    resource_type: Mapped[str] = mapped_column(String(40))
    resource_id: Mapped[str] = mapped_column(String(64))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
