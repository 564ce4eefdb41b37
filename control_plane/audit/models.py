"""The audit log's table."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base, utcnow


class AuditEntry(Base):
    """One admin change: who, what, when, the resource before and after (secret-free
    snapshots). Written in the same transaction as the change itself, so there is never a
    change without its entry, nor an entry for a change that rolled back."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_org_at", "org_id", "at"),
        # An organisation's entries newest first (its admins' audit page) from the index alone:
        # by (org_id, at) the database would read all of them to sort them by id.
        Index("ix_audit_log_org_newest", "org_id", "id"),
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
