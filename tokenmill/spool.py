"""A local, durable spool in front of a publisher, so usage events survive a bus outage.

`SpoolingPublisher` wraps any `Publisher` (a `RedisBus`, `MemoryBus` or `HttpPublisher`).
For the spooled streams (usage by default) an event that the bus cannot take, within
`publish_timeout`, is appended to a file in the spool directory (one JSON line, fsync'd
before `publish` returns) instead of being lost, and a background task publishes the spooled
events again, in order, once the bus answers. While anything is spooled, new events of those
streams are spooled too: that keeps their order and spares a dead Redis a connection attempt
per request.

Delivery is at least once (the ledger inserts idempotently by request id): a crash between
publishing a spooled event and forgetting it publishes it again, but nothing is removed
before it was delivered.

Files (`<host>.<pid>.<incarnation>` identifies one `SpoolingPublisher` in one process):

- `<owner>.spool`: where events are appended; only its owner writes to it.
- `<owner>.<seq>.replaying`: a spool file handed over to the replay task, by an atomic
  rename, so appends never race with reading and deleting. It is deleted once every line
  was published.
- `<that>.replaying.offset`: how far a `.replaying` file was delivered, written when a
  replay stops half-way (bus down again, shutdown), so the next one need not start over.
  Only a saving: without it (a crash), delivered lines are sent again.

On `start()` the files of dead owners on this host (their pid is gone, or it is our own pid
with another incarnation, i.e. a previous life of this process with a recycled pid) are
claimed by renaming them to our own names, and replayed before anything new. Files of
other hosts are left alone: a pid says nothing about a process on another machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import msgspec
from redis.exceptions import RedisError

from tokenmill.bus import BusError, Event, Publisher, encode
from tokenmill.protocol import USAGE
from tokenmill.tasks import Background, cancels, honour_cancel

log = logging.getLogger(__name__)

T = TypeVar("T")

SPOOL_SUFFIX = ".spool"
REPLAYING_SUFFIX = ".replaying"
OFFSET_SUFFIX = ".offset"
# <host>.<pid>.<incarnation>.spool | <host>.<pid>.<incarnation>.<seq>.replaying; hostnames may
# contain dots, so everything is anchored on the right.
_NAME = re.compile(r"^(?P<host>.+)\.(?P<pid>\d+)\.(?P<inc>[0-9a-f]+)(?:\.(?P<seq>\d+)\.replaying|\.spool)$")
# Lines read from a file per round trip to the IO thread while replaying.
_REPLAY_BATCH = 256

# Incarnations alive in this process: another SpoolingPublisher on the same directory has
# our pid, and must not take our files for a dead predecessor's.
_live_incarnations: set[str] = set()
_live_lock = threading.Lock()


def _outage_errors() -> tuple[type[BaseException], ...]:
    """What a publisher raises when the bus cannot take an event now (vs. a bug of ours).

    Redis errors all count, not only connection ones: a Redis that is loading, read-only
    after a failover or out of memory answers with an error, and the event must still not
    be lost.
    """
    # HttpPublisher wraps its transport errors in BusPublishError (a BusError).
    return (BusError, RedisError, OSError, TimeoutError)


OUTAGE_ERRORS = _outage_errors()


class SpoolLine(msgspec.Struct):
    """One spooled event; `event` is kept as the JSON it was encoded to, and published as is."""

    stream: str
    event: msgspec.Raw


_line_decoder = msgspec.json.Decoder(SpoolLine)


def _hostname() -> str:
    # Only what is safe in a file name; dots are fine (names are parsed from the right).
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _count_lines(path: Path, offset: int = 0) -> int:
    """Lines of a spool file after `offset`, a torn last one included, read in chunks."""
    n = 0
    last = b"\n"
    with path.open("rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _offset_file(path: Path) -> Path:
    return path.with_name(path.name + OFFSET_SUFFIX)


def _read_offset(path: Path) -> int:
    """Where a previous replay of `path` stopped; 0 (start over) when unknown or unreadable."""
    try:
        offset = int(_offset_file(path).read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return 0
    return offset if 0 <= offset <= size else 0


def _fsync_dir(directory: Path) -> None:
    """Make a create/rename in `directory` durable (the file's own fsync does not cover it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolingPublisher(Background):
    """A `Publisher` that spools events of `streams` to `directory` when `inner` fails.

    `start()` claims spool files left by dead processes and starts the replay loop;
    `stop()` ends it after one last bounded replay attempt (what is left stays on disk for
    the next start). Events of other streams go straight to `inner`, errors included.
    `inner` is closed by `close()` only when `owns_inner`.
    """

    name = "spool-replay"

    def __init__(
        self,
        inner: Publisher,
        directory: Path,
        *,
        streams: Iterable[str] = frozenset({USAGE}),
        replay_interval: float = 1.0,
        publish_timeout: float = 2.0,
        owns_inner: bool = False,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.directory = Path(directory)
        self.streams = frozenset(streams)
        self.replay_interval = replay_interval
        self.publish_timeout = publish_timeout
        self._owns_inner = owns_inner

        self._host = _hostname()
        self._pid = os.getpid()
        # Start time first, so that sorting claimed files by incarnation replays older ones first.
        self._inc = f"{time.time_ns() // 1_000_000:013x}{secrets.token_hex(3)}"
        self._owner = f"{self._host}.{self._pid}.{self._inc}"
        self._active = self.directory / f"{self._owner}{SPOOL_SUFFIX}"
        with _live_lock:
            _live_incarnations.add(self._inc)

        # Every file operation runs on this one thread, in submission order: appends keep the
        # order of `publish` calls and never interleave with a rotation, even when the awaiting
        # caller is cancelled half-way (the job still runs, in its turn).
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool-io")
        self._fd: int | None = None  # the active file, open for appending (IO thread only)
        self._seq = 0  # next .replaying sequence number (IO thread only)
        # True while anything is spooled; set and cleared on the IO thread, in order with the
        # appends, so an event is never left in a file the replay loop has stopped looking at.
        self._spooling = False
        self._spooling_since = 0.0
        # Files to replay, oldest first: appended to on the IO thread (rotations, claims),
        # consumed by `replay()`. How far each was delivered, when not from its start.
        self._queue: list[Path] = []
        self._offsets: dict[Path, int] = {}
        self._saved_offset: tuple[Path, int] | None = None
        self._replay_lock = asyncio.Lock()
        # pending() = _added - _done; each counter is written by one thread only.
        self._added = 0  # IO thread
        self._done = 0  # event loop
        self._started = False

    # --- Publisher ------------------------------------------------------------------------

    async def publish(self, stream: str, event: Event) -> str:
        if stream not in self.streams:
            return await self.inner.publish(stream, event)
        payload = encode(event)  # an unencodable event is the caller's bug: raise, don't spool
        if not self._spooling:
            try:
                return await self._publish_inner(stream, payload)
            except OUTAGE_ERRORS as exc:
                reason: BaseException | None = exc
        else:
            reason = None  # already spooling: keep the order, don't touch the bus
        line = encode(SpoolLine(stream=stream, event=msgspec.Raw(payload))) + b"\n"
        try:
            n = await self._run_io(self._append, line, reason)
        except OSError:
            log.exception("spool: cannot store an event of %s in %s: it is lost", stream, self.directory)
            raise
        return f"spool-{n}"

    async def close(self) -> None:
        """`stop()`, then release the IO thread (and `inner` when owned); not usable after."""
        await self.stop()
        self._io.shutdown(wait=True)
        if self._owns_inner:
            await self.inner.close()

    # --- introspection --------------------------------------------------------------------

    def pending(self) -> int:
        """Events spooled (or found at start) and not yet delivered, torn lines included."""
        return max(0, self._added - self._done)

    @property
    def spooling(self) -> bool:
        return self._spooling

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        claimed, lines = await self._run_io(self._claim_orphans)
        if claimed:
            log.warning(
                "spool: %d event(s) left by a previous process in %s; replaying them",
                lines,
                self.directory,
            )
        self._started = True
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._started and (self._spooling or self._queue):
            # One last attempt, bounded: a dead bus must not hold the shutdown up, and what is
            # left stays on disk for the next start.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.publish_timeout):
                    await self.replay()
            with contextlib.suppress(OSError):
                await self._save_offset()
        self._started = False
        await self._run_io(self._close_active)
        with _live_lock:
            _live_incarnations.discard(self._inc)
        if self.pending():
            log.warning("spool: %d event(s) stay in %s until the next start", self.pending(), self.directory)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.replay_interval)
            if self._spooling or self._queue:
                try:
                    await self.replay()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # Never let the loop die: the events are still on disk, try again later.
                    log.exception("spool: replay failed; retrying in %.1fs", self.replay_interval)

    # --- replay ---------------------------------------------------------------------------

    async def replay(self) -> bool:
        """Publish everything spooled, oldest first; True when the spool is empty afterwards.

        Stops at the first event the bus refuses (to try again later, from that event).
        """
        async with self._replay_lock:
            while True:
                while self._queue:
                    if not await self._replay_file(self._queue[0]):
                        await self._save_offset()
                        return False
                    path = self._queue.pop(0)
                    self._offsets.pop(path, None)
                    await self._run_io(self._remove, path)
                # Hand over what was appended meanwhile; when nothing was, the spool is drained
                # (decided on the IO thread, in order with appends).
                if not await self._run_io(self._rotate):
                    return True

    async def _replay_file(self, path: Path) -> bool:
        while True:
            try:
                batch = await self._run_io(self._read_lines, path, self._offsets.get(path, 0))
            except FileNotFoundError:
                log.error("spool: %s vanished before it was replayed", path)
                return True
            if not batch:
                return True
            for end, raw in batch:
                try:
                    if not raw.endswith(b"\n"):
                        raise msgspec.DecodeError("no line end")
                    line = _line_decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    # A write cut short by a crash (or a damaged disk): the event is lost either
                    # way, and the lines after it are not.
                    at = self._offsets.get(path, 0)
                    log.warning("spool: skipping a torn line in %s at byte %d (%s)", path, at, exc)
                else:
                    try:
                        await self._publish_inner(line.stream, bytes(line.event))
                    except OUTAGE_ERRORS as exc:
                        log.info("spool: the bus is still unreachable (%r); %d pending", exc, self.pending())
                        return False
                self._offsets[path] = end
                self._done += 1

    async def _save_offset(self) -> None:
        """Record how far the file being replayed was delivered, if that changed."""
        if not self._queue:
            return
        path = self._queue[0]
        current = (path, self._offsets.get(path, 0))
        if current[1] and current != self._saved_offset:
            await self._run_io(self._write_offset, *current)
            self._saved_offset = current

    async def _publish_inner(self, stream: str, payload: bytes) -> str:
        # The timeout also covers a bus that accepts connections but never answers; if the
        # event did arrive after all, the replay delivers it again, which the ledger absorbs.
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops an outside cancellation
        # that arrives as the awaited call completes.
        before = cancels()
        async with asyncio.timeout(self.publish_timeout):
            entry_id = await self.inner.publish(stream, msgspec.Raw(payload))
        # redis-py (8.1) sends each command inside wait_for, which on Python 3.11 loses most
        # cancels that land during the send: without this, stop() waits forever on a replay
        # loop that never saw its cancel (and the bounded final replay would not be bounded).
        honour_cancel(before)
        return entry_id

    async def _run_io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # --- IO thread ------------------------------------------------------------------------

    def _append(self, line: bytes, reason: BaseException | None) -> int:
        if not self._spooling:
            self._spooling = True
            self._spooling_since = time.monotonic()
            log.warning(
                "spool: the bus is unreachable (%s); spooling events of %s to %s",
                repr(reason) if reason is not None else "it failed while the spool drained",
                ", ".join(sorted(self.streams)),
                self.directory,
            )
        if self._fd is None:
            self._open_active()
        assert self._fd is not None
        try:
            view = memoryview(line)
            while view:  # a short write is legal for write(2); finish the line
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError:
            # Disk full, I/O error: the caller learns that this event was not stored. Reopen next
            # time, which terminates whatever part of this line got written.
            self._close_active()
            raise
        self._added += 1
        return self._added

    def _open_active(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._active, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                _fsync_dir(self.directory)  # a new file: make its name as durable as its lines
            else:
                # Left by a failed write: end that fragment so the next line is not glued to it
                # (the fragment is then skipped as one torn line, this event is not).
                with open(self._active, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        os.write(fd, b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _close_active(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _next_replaying(self) -> Path:
        path = self.directory / f"{self._owner}.{self._seq:06d}{REPLAYING_SUFFIX}"
        self._seq += 1
        return path

    def _rotate(self) -> bool:
        """Queue the active file for replay (True), or, when nothing is in it, end spooling.

        The queue is appended to here rather than by the awaiting caller, so that a file
        rotated while that caller is cancelled (shutdown) is still replayed.
        """
        self._close_active()
        try:
            empty = self._active.stat().st_size == 0
        except FileNotFoundError:
            empty = True
        if empty:
            with contextlib.suppress(FileNotFoundError):
                self._active.unlink()
            if self._spooling:
                self._spooling = False
                log.info(
                    "spool: drained; the bus takes events again after %.1fs",
                    time.monotonic() - self._spooling_since,
                )
            return False
        target = self._next_replaying()
        os.rename(self._active, target)
        _fsync_dir(self.directory)
        self._queue.append(target)
        return True

    @staticmethod
    def _write_offset(path: Path, offset: int) -> None:
        # Written aside and renamed: a reader sees the old offset or the new one, never half.
        tmp = path.with_name(path.name + OFFSET_SUFFIX + ".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, _offset_file(path))

    @staticmethod
    def _remove(path: Path) -> None:
        path.unlink(missing_ok=True)
        _offset_file(path).unlink(missing_ok=True)

    @staticmethod
    def _read_lines(path: Path, offset: int) -> list[tuple[int, bytes]]:
        """Up to a batch of lines from `offset`, each with the offset just past it.

        A last line without its newline is returned as is: the caller skips it as torn.
        """
        out: list[tuple[int, bytes]] = []
        with path.open("rb") as f:
            f.seek(offset)
            for _ in range(_REPLAY_BATCH):
                raw = f.readline()
                if not raw:
                    break
                offset += len(raw)
                out.append((offset, raw))
        return out

    def _claim_orphans(self) -> tuple[list[Path], int]:
        """Rename the files of dead owners on this host to ours; returns them, oldest first,
        and how many lines they hold."""
        if not self.directory.is_dir():
            return [], 0
        with _live_lock:
            live = set(_live_incarnations)
        found: list[tuple[str, int, int, Path]] = []
        for path in self.directory.iterdir():
            sidecar = path.name.endswith(OFFSET_SUFFIX)
            m = _NAME.match(path.name.removesuffix(OFFSET_SUFFIX))
            if m is None or m["host"] != self._host or m["inc"] == self._inc:
                continue
            pid = int(m["pid"])
            if pid == self._pid:
                if m["inc"] in live:
                    continue  # another SpoolingPublisher of this process
            elif _pid_alive(pid):
                continue
            if sidecar:
                # Handled with its file; alone, it outlived a file deleted just before a crash.
                if not path.with_name(path.name.removesuffix(OFFSET_SUFFIX)).exists():
                    path.unlink(missing_ok=True)
                continue
            # Within an owner: its .replaying files in sequence, then its active file.
            seq = int(m["seq"]) if m["seq"] is not None else 1 << 62
            found.append((m["inc"], pid, seq, path))
        claimed: list[Path] = []
        lines = 0
        for _inc, _pid, _seq, path in sorted(found, key=lambda t: t[:3]):
            # Where the previous owner stopped delivering, if it said so.
            offset = _read_offset(path)
            target = self._next_replaying()
            try:
                os.rename(path, target)  # atomic: when two starting processes race, one wins
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM):
                    raise
                log.error("spool: cannot claim %s: %s", path, exc)
                continue
            claimed.append(target)
            if offset:
                self._offsets[target] = offset
            # Kept in memory from now on (and saved under the new name when replay stops).
            _offset_file(path).unlink(missing_ok=True)
            lines += _count_lines(target, offset)
        if claimed:
            _fsync_dir(self.directory)
            # Before anything this incarnation may already have rotated: older events first.
            self._queue[:0] = claimed
            self._spooling = True
            self._spooling_since = time.monotonic()
        self._added += lines  # found events count as pending until replayed
        return claimed, lines
