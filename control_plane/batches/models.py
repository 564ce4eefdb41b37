"""The batches' tables."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base


class Batch(Base):
    """One batch: OpenAI's Batch object, field for field, plus what the runner needs (its lease
    and the tokens it holds of the organisation's batch queue)."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_status", "status"),)

    # batch_<creation time in ms, 12 hex digits><12 random hex digits>: sorts by creation.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Every read is by (id, org_id): another organisation's batch is a 404, like a missing one.
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    # The key that created it: its lines are served (and metered) as that key's requests.
    api_key_id: Mapped[str | None] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16))
    # `metadata` is taken on a declarative class; the column keeps OpenAI's name.
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # why it failed
    model: Mapped[str | None] = mapped_column(String(200))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Its estimated tokens (prompt + max output, counted at validation), held against the
    # organisation's batch queue limit until it ends.
    queued_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    # The runner working on it, until when: another may take it over once the lease lapses
    # (the first crashed), and resumes from its lines' rows.
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]


class BatchLine(Base):
    """One request line of a batch's input file (numbered from 1, blank lines counted), from its
    validation to the batch's end: `pending` with its request `body`, then `ok` or `failed`
    with `result`, the line of the output or error file it becomes. A line's result is written
    once; a runner taking over runs only the pending ones."""

    __tablename__ = "batch_lines"
    __table_args__ = (Index("ix_batch_lines_state", "batch_id", "state", "line"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    custom_id: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(8))  # pending | ok | failed
    body: Mapped[str | None] = mapped_column(Text)  # the request body (JSON), while pending
    result: Mapped[str | None] = mapped_column(Text)  # the output or error file's line (JSON)
