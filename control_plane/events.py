"""Domain events: what a change does beyond its rows, collected while it is made.

Services add events to the outbox of the session they work in (`outbox(session)`), so a
service calling another (disabling a user revokes its keys) collects into the same one. The
unit of work (control_plane/unit.py) commits the session, then delivers the `committed`
events: announcements on the bus (gateways drop what they cached of a key or an
organisation), files to remove from storage (a deleted adapter's). If the transaction does
not commit, it delivers the `rolled_back` ones instead: what was done outside the database
for rows that will never exist (an upload's stored files).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from tokenmill.protocol import KeysChanged
from tokenmill.storage import Storage

log = logging.getLogger("tokenmill.control_plane")

_OUTBOX = "tokenmill.outbox"


@dataclass(frozen=True, slots=True)
class FilesOrphaned:
    """Stored files no row points at: a deleted adapter's, or an upload's whose row was
    never committed."""

    storage: Storage
    prefix: str

    def remove(self) -> None:
        """Blocking (run it in a thread)."""
        try:
            self.storage.delete_prefix(self.prefix)
        except Exception:  # the storage may be what failed; the files are unreferenced either way
            log.exception("could not remove stored files under %s", self.prefix)


Event = KeysChanged | FilesOrphaned


@dataclass(slots=True)
class Outbox:
    committed: list[Event] = field(default_factory=list)  # delivered once the change is committed
    rolled_back: list[Event] = field(default_factory=list)  # delivered if it never is

    def keys_changed(self, *, prefix: str | None = None, org_id: str | None = None) -> None:
        """Gateways must re-read a key (`prefix`) or every key of an organisation."""
        event = KeysChanged(prefix=prefix, org_id=org_id)
        if event not in self.committed:
            self.committed.append(event)

    def clear(self) -> None:
        self.committed.clear()
        self.rolled_back.clear()


def outbox(session: AsyncSession) -> Outbox:
    """The outbox of `session`'s unit of work (one per session, in `Session.info`)."""
    box = session.info.get(_OUTBOX)
    if box is None:
        box = session.info[_OUTBOX] = Outbox()
    return box
