"""The stored responses' table."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base


class StoredResponse(Base):
    """One response of `/v1/responses` created with `store` (the default): the Response object
    as it was answered, and the conversation it answered (its input items, those of the
    responses it continued included), so that a later request can continue from it with
    `previous_response_id` even after its predecessors are deleted or expired."""

    __tablename__ = "stored_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_...
    # Every read is by (id, org_id): another organisation's response is a 404, like a missing one.
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(200))
    response: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object, as answered
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # the conversation, each with an id
    created_at: Mapped[datetime]
    # Past it, a response reads as missing; the periodic purge deletes it (indexed for that).
    expires_at: Mapped[datetime] = mapped_column(index=True)
