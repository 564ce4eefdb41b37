"""What the in-memory bus must not lose in a crash: a stream's entries until every group
reading it has acknowledged them.

In the embedded mode the usage events live in the server's memory between the request that
published them and the billing consumer's commit; a crash in between (SIGKILL, the OOM
killer) would lose them, and a batch line answered in that window would never be billed.
`Journal` appends each entry, and each acknowledgement, to one file as it happens (a single
`write` to an `O_APPEND` descriptor, which a crash of the process cannot tear), and on the
next start hands back the entries some group had not acknowledged, to be delivered again.
Delivery is at least once: the ledger absorbs a duplicate by request id.

Not fsync'd: a crash of the process leaves what was written in the kernel's cache, which
reaches the disk; a crash of the machine may lose the last seconds (the Redis bus, for
production, has its own persistence).

Lines: `E <id> <data>` for an entry, `A <json [group, id, ...]>` for acknowledgements. The file
is rewritten with only the live entries once it has grown by `compact_bytes`, and emptied
whenever nothing is live. One bus at a time owns it (an exclusive `flock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

COMPACT_BYTES = 4 << 20


class JournalBusy(Exception):
    """Another bus (in this process or another) holds the journal."""


class Journal:
    """One stream's entries, kept on disk while some group has not acknowledged them."""

    def __init__(self, path: Path, *, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            raise JournalBusy(f"{path} is held by another bus") from exc
        # entry id -> its line, until every group acked it; in id order (appends only grow)
        self._live: dict[str, bytes] = {}
        self._acked: dict[str, set[str]] = {}  # groups that acked a live entry
        self._grown = 0  # bytes appended since the file was last rewritten

    def recover(self) -> list[tuple[str, bytes]]:
        """(id, data) of the entries some group has not acknowledged, oldest first; the
        file is rewritten with only those. A group counts once it has acknowledged anything:
        with none yet, every entry is still due."""
        with open(self.path, "rb") as f:
            raw = f.read()
        entries: dict[str, bytes] = {}
        acks: dict[str, set[str]] = {}
        groups: set[str] = set()
        # A last line with no newline was cut short (a machine crash): nothing to trust in it.
        for line in raw.split(b"\n")[:-1]:
            try:
                kind, _, rest = line.partition(b" ")
                if kind == b"E":
                    sid, _, data = rest.partition(b" ")
                    ms, _, seq = sid.partition(b"-")
                    int(ms), int(seq)  # garbage from a crash is dropped, not delivered
                    msgspec.json.decode(data)
                    entries[sid.decode()] = data
                elif kind == b"A":
                    group, *ids = msgspec.json.decode(rest, type=list[str])
                    groups.add(group)
                    for i in ids:
                        acks.setdefault(i, set()).add(group)
                else:
                    raise ValueError(kind)
            except (ValueError, UnicodeDecodeError, msgspec.DecodeError):
                log.warning("journal %s: skipping a damaged line (%d bytes)", self.path, len(line))
        due = [(s, data) for s, data in entries.items() if not groups or not groups <= acks.get(s, set())]
        self._live = {sid: self._line(sid, data) for sid, data in due}
        self._acked = {sid: acks[sid] for sid, _ in due if sid in acks}
        self._rewrite()
        return due

    @staticmethod
    def _line(sid: str, data: bytes) -> bytes:
        return b"E %s %s\n" % (sid.encode(), data)

    def append(self, sid: str, data: bytes) -> None:
        line = self._line(sid, data)
        self._write(line)
        self._live[sid] = line

    def ack(self, group: str, groups: set[str], sids: list[str]) -> None:
        """`group` acknowledged `sids`; an entry is done once every one of `groups` (those
        reading the stream now) has."""
        sids = [s for s in sids if s in self._live]
        if not sids:
            return
        self._write(b"A " + msgspec.json.encode([group, *sids]) + b"\n")
        for sid in sids:
            done = self._acked.setdefault(sid, set())
            done.add(group)
            if groups <= done:
                del self._live[sid]
                del self._acked[sid]
        if not self._live:
            os.ftruncate(self._fd, 0)
            self._grown = 0
        elif self._grown >= self.compact_bytes:
            self._rewrite()

    def forget(self, sid: str) -> None:
        """`sid` was trimmed from the stream: nothing left to deliver."""
        self._live.pop(sid, None)
        self._acked.pop(sid, None)

    def _write(self, data: bytes) -> None:
        os.write(self._fd, data)
        self._grown += len(data)

    def _rewrite(self) -> None:
        """The file with only the live entries (their acknowledgements are kept in memory and
        written again as one line per group), swapped in by a rename."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        by_group: dict[str, list[str]] = {}
        for sid, groups in self._acked.items():
            for g in groups:
                by_group.setdefault(g, []).append(sid)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can have the new file
        lines = [*self._live.values()]
        lines += [b"A " + msgspec.json.encode([g, *ids]) + b"\n" for g, ids in by_group.items()]
        os.write(fd, b"".join(lines))
        os.fsync(fd)
        os.replace(tmp, self.path)
        old, self._fd = self._fd, fd
        os.close(old)
        self._grown = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
