"""Wire types of the rollups' admin API."""

from __future__ import annotations

from datetime import datetime

import msgspec


class RollupRun(msgspec.Struct, forbid_unknown_fields=True):
    """Recompute the rollups of the hours covering [from, to) (ISO dates or times, UTC)."""

    start: str = msgspec.field(name="from")
    end: str = msgspec.field(name="to")


class RollupRunOut(msgspec.Struct):
    start: datetime = msgspec.field(name="from")
    end: datetime = msgspec.field(name="to")
    rows: int
    inserted: int
    updated: int
    deleted: int
