"""The files' table."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenmill.db import Base


class StoredFile(Base):
    """One file of an organisation; its bytes are in the storage under `key`. A row is added
    only once its bytes are stored, and deleted before them, so a row never names missing
    bytes."""

    __tablename__ = "files"

    # file-<creation time in ms, 12 hex digits><12 random hex digits>: ids sort by creation,
    # so a listing pages by id alone (a cursor still works after its file is deleted).
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Every read is by (id, org_id): another organisation's file is a 404, like a missing one.
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    size: Mapped[int] = mapped_column(BigInteger)  # bytes
    # Lines of the file (the last one counted without its newline too): a batch's requests.
    lines: Mapped[int]
    created_at: Mapped[datetime]

    @property
    def key(self) -> str:
        """Where its bytes are in the storage."""
        return file_key(self.org_id, self.id)


def file_key(org_id: str, file_id: str) -> str:
    return f"files/{org_id}/{file_id}"
