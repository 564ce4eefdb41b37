"""Tables of tenants: organisations, users, their dashboard sign-ins and API keys. Read by the
gateway (keys) and billing."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column, relationship

from control_plane.plans.models import Plan
from tokenmill.db import Base, Timestamped, new_id


class Organization(Timestamped, Base):
    __tablename__ = "organizations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("org"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    plan_id: Mapped[str | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"))
    # Mixed into every block hash of this organisation's prompts so tenants never share cache.
    cache_salt: Mapped[str] = mapped_column(String(64), default=lambda: new_id("salt"))
    # control_plane.policy.ACTIVE or SUSPENDED
    status: Mapped[str] = mapped_column(String(20), default="active")
    billing_mode: Mapped[str] = mapped_column(String(20), default="none")  # none | invoices | meters
    stripe_customer_id: Mapped[str | None] = mapped_column(String(100))

    plan: Mapped[Plan | None] = relationship(lazy="raise")


class User(Timestamped, Base):
    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("user"))
    org_id: Mapped[str | None] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    email: Mapped[str] = mapped_column(String(320), unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20), default="member")  # control_plane.policy.ROLES
    disabled: Mapped[bool] = mapped_column(default=False)


class DashboardSession(Base):
    """A user's sign-in to the dashboard (control_plane/orgs/sessions.py). The browser holds a
    random token; only its SHA-256 is kept, so reading this table signs nobody in."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex SHA-256 of the token
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime]
    # Indexed for the purge of expired sessions at each sign-in.
    expires_at: Mapped[datetime] = mapped_column(index=True)


class ApiKey(Timestamped, Base):
    """Only `prefix` (for lookup) and a keyed hash of the whole key are stored."""

    __tablename__ = "api_keys"
    # An organisation's keys in creation order, the keyset of their list (control_plane/
    # paging.py): a page of 10,000 keys is read from the index, not sorted each time.
    __table_args__ = (Index("ix_api_keys_org_created", "org_id", "created_at", "id"),)

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
