"""The event bus: append-only streams of JSON events (worker heartbeats, KV events, usage).

Two implementations behind one interface:

- `RedisBus`: Redis Streams, shared by every gateway replica, billing and the workers.
- `MemoryBus`: in-process, for the embedded mode; local workers reach it through the
  internal HTTP endpoint (`tokenmill/internal.py`) with an `HttpPublisher`.

Entry ids look like Redis's `<ms>-<seq>` in both, so a reader can keep "the last id I saw"
and resume from it whichever backend runs. Streams are capped (approximately, like
`XADD MAXLEN ~`) so a stream nobody reads cannot grow without bound; on Redis, the usage
stream instead is trimmed only behind the consumer groups reading it (see `RedisBus`).

Two ways to read:

- `read(stream, after)`: every reader sees every entry (fan-out), e.g. each gateway
  replica tails the worker and KV streams for its fleet view.
- `read_group(stream, group, consumer)` + `ack`: consumer groups, each entry goes to one
  consumer of the group and stays pending until acknowledged (at-least-once), e.g.
  billing's usage consumer. A consumer's un-acknowledged entries are delivered again the
  first time a new bus instance reads for that consumer name (i.e. after a restart), or
  after `replay_pending`; on Redis, those of a consumer that died (whose name never comes
  back) are claimed by another consumer of the group once idle for `claim_idle` seconds.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import urllib.parse
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx
import msgspec

from tokenmill.journal import Journal, JournalBusy
from tokenmill.protocol import USAGE

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tokenmill.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_MAXLEN = 100_000
# Seconds a Redis client waits to connect, and for each reply beyond a blocking read's own
# wait (TOKENMILL_REDIS_TIMEOUT_SECONDS): a Redis that accepts and never answers (stopped,
# hung) then fails calls with an outage error (tokenmill.spool.OUTAGE_ERRORS) instead of
# hanging them.
REDIS_TIMEOUT = 2.0
# The longest a `RedisBus` read blocks in Redis (XREAD/XREADGROUP BLOCK); callers loop.
MAX_BLOCK = 4.0
# Usage events must outlast a consumer outage (each is money): ~20 minutes at 1,500 events/s
# in memory (`MemoryBus`: its consumer runs in the same process). Redis: see below.
STREAM_MAXLEN: dict[str, int | None] = {USAGE: 2_000_000}
# On Redis the usage stream is never capped when published, since a cap drops what billing has
# not read yet, however long it was down: `RedisBus.read_group` trims every uncapped stream it
# reads behind all the groups reading it (XTRIM MINID), so it is bounded by need. Fan-out
# streams (workers, KV) stay capped: gateways tail them and nothing waits for them.
REDIS_STREAM_MAXLEN: dict[str, int | None] = {USAGE: None}
# Streams a server's `MemoryBus` keeps on disk until acknowledged, so a crash loses none.
JOURNALED = (USAGE,)
# Seconds a group's pending entry must sit idle (since its last delivery) before another
# consumer claims it (XAUTOCLAIM): its consumer is presumed dead, and a restarted one has a new
# name (hostname-pid; pods are renamed on every restart), so nobody else would ever read it.
# A live consumer never leaves entries idle that long: it acks each batch once handled, and a
# retry re-reads its pending entries (which resets their idle time) about every second. Only a
# single slow attempt ages them, and the longest bounded wait inside one (connecting to
# PostgreSQL, asyncpg's 60 s) is half this. Robbing a live consumer would only cost a
# redelivery (inserts are idempotent); waiting longer only delays the ledger after a crash.
CLAIM_IDLE = 120.0
# Seconds between a consumer's trims of an uncapped stream behind its groups.
TRIM_INTERVAL = 10.0
# XTRIM MINID ~ evicts at most this many entries a call (Redis's own default LIMIT); a large
# backlog is trimmed in several calls rather than one that blocks Redis.
_TRIM_CHUNK = 10_000


def stream_maxlen_of(overrides: Mapping[str, int | None] | None) -> dict[str, int | None]:
    """Per-stream caps (`MemoryBus`): the defaults above, then `overrides`."""
    return {**STREAM_MAXLEN, **(overrides or {})}


def redis_stream_maxlen_of(overrides: Mapping[str, int | None] | None) -> dict[str, int | None]:
    """Per-stream caps on Redis (`RedisBus`, `RespPublisher`): the usage stream uncapped
    (trimmed behind its groups instead), then `overrides`."""
    return {**STREAM_MAXLEN, **REDIS_STREAM_MAXLEN, **(overrides or {})}


# Field holding the JSON payload in a Redis stream entry.
FIELD = b"d"

# `msgspec.Raw` is JSON that is already encoded: every publisher encodes with `encode`, which
# passes it through verbatim, so a stored event can be published again as is (the usage spool).
Event = msgspec.Struct | msgspec.Raw | dict[str, Any]
Entry = tuple[str, bytes]  # (entry id, raw JSON)
StreamID = tuple[int, int]  # (milliseconds, sequence), ordered like Redis ids


class BusError(RuntimeError):
    """Base class of the bus's own errors."""


class BusPublishError(BusError):
    """An event could not be published (internal endpoint refused it or is unreachable)."""


class BusConfigError(BusError):
    """The settings do not say where events should go."""


def encode(event: Event) -> bytes:
    return msgspec.json.encode(event)


def parse_id(entry_id: str) -> StreamID:
    """`"<ms>-<seq>"` (or a bare `"<ms>"`, meaning seq 0, as Redis reads it) to a comparable tuple."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"invalid stream entry id {entry_id!r}") from None


def format_id(sid: StreamID) -> str:
    return f"{sid[0]}-{sid[1]}"


@runtime_checkable
class Publisher(Protocol):
    """What a producer needs: workers (heartbeats, KV events) and the gateway (usage)."""

    async def publish(self, stream: str, event: Event) -> str:
        """Append `event` (encoded with `msgspec.json.encode`) and return its entry id."""
        ...

    async def close(self) -> None: ...


class EventBus(Publisher):
    """Publisher plus readers. Subclasses: `MemoryBus`, `RedisBus`."""

    @abstractmethod
    async def publish(self, stream: str, event: Event) -> str: ...

    @abstractmethod
    async def read(
        self, stream: str, after: str = "$", *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        """Entries with an id strictly greater than `after`, oldest first, at most `count`.

        `after="$"` means only entries added after this call starts (callers then keep the
        last id they saw and pass it next time; use `last_id` to start from "now" without a
        gap), `"0"` means from the beginning. Waits up to `block` seconds when there is
        nothing yet (`block <= 0`: do not wait) and returns `[]` on timeout.
        """

    @abstractmethod
    async def last_id(self, stream: str) -> str:
        """The id of the last entry ever added (`"0-0"` for a new stream).

        Reading with `after=last_id()` then sees everything published after this call,
        which `"$"` cannot promise across successive calls.
        """

    @abstractmethod
    async def read_group(
        self, stream: str, group: str, consumer: str, *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        """Entries for `consumer` of `group` (created on first use, from the stream's start).

        First this consumer's pending (delivered, not acknowledged) entries, the first time
        this bus instance reads for it or after `replay_pending`; then (Redis) entries other
        consumers left pending past the claim threshold (they died); then new entries, each
        delivered to exactly one consumer of the group. Pending entries whose data was
        trimmed away meanwhile are acknowledged and skipped (nothing left to deliver).
        """

    @abstractmethod
    async def ack(self, stream: str, group: str, *ids: str) -> int:
        """Acknowledge entries of `group`; returns how many were pending."""

    @abstractmethod
    async def replay_pending(self, stream: str, group: str, consumer: str) -> None:
        """Make the next `read_group` of `consumer` start again with its pending entries.

        A consumer that failed to process a batch calls this to retry it without a restart.
        """

    @abstractmethod
    async def close(self) -> None: ...


# --- in memory --------------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    cursor: StreamID = (0, 0)  # last entry delivered to any consumer of the group
    owner: dict[StreamID, str] = field(default_factory=dict)  # pending entry -> consumer
    # consumer -> its pending entries; insertion order is id order since deliveries only
    # move forward.
    pending: dict[str, dict[StreamID, None]] = field(default_factory=dict)


@dataclass(slots=True)
class _Stream:
    ids: list[StreamID] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    last: StreamID = (0, 0)
    # Set (and replaced) on every publish: waiting readers take the current event, so a
    # publish between their check and their wait still wakes them.
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    groups: dict[str, _Group] = field(default_factory=dict)


class MemoryBus(EventBus):
    """In-process bus for the embedded mode. Not shared between processes.

    With `journal_dir`, the streams of `JOURNALED` (usage: money) are also kept on disk until
    their groups acknowledge them (`tokenmill.journal`), and what a crashed predecessor left
    unacknowledged is published again, under its old ids, before anything new.
    """

    def __init__(
        self,
        *,
        maxlen: int = DEFAULT_MAXLEN,
        stream_maxlen: Mapping[str, int | None] | None = None,
        journal_dir: Path | None = None,
    ):
        self._maxlen = maxlen
        self._stream_maxlen = stream_maxlen_of(stream_maxlen)
        self._streams: dict[str, _Stream] = {}
        # (stream, group, consumer) -> position in the consumer's pending entries while
        # replaying them; None once caught up (then new entries are delivered).
        self._replay: dict[tuple[str, str, str], StreamID | None] = {}
        self._closed = False
        self._journals: dict[str, Journal] = {}
        for stream in JOURNALED if journal_dir is not None else ():
            self._open_journal(stream, journal_dir / f"{stream.replace(':', '-')}.journal")

    def _open_journal(self, stream: str, path: Path) -> None:
        try:
            journal = Journal(path)
        except JournalBusy:
            # Two servers on one home: the first keeps the journal; this one runs without.
            log.warning("bus: %s is in use by another server; %s is kept in memory only", path, stream)
            return
        st = self._stream(stream)
        recovered = journal.recover()
        for entry_id, data in recovered:
            st.ids.append(parse_id(entry_id))
            st.entries.append((entry_id, data))
        if recovered:
            st.last = st.ids[-1]
            log.warning("bus: %d unacknowledged entries of %s delivered again", len(recovered), stream)
        self._journals[stream] = journal

    def _stream(self, name: str) -> _Stream:
        st = self._streams.get(name)
        if st is None:
            st = self._streams[name] = _Stream()
        return st

    def _next_id(self, st: _Stream) -> StreamID:
        ms = time.time_ns() // 1_000_000
        # Same rule as Redis: never go backwards, even if the wall clock does.
        return (ms, 0) if ms > st.last[0] else (st.last[0], st.last[1] + 1)

    def _trim(self, name: str, st: _Stream) -> None:
        maxlen = self._stream_maxlen.get(name, self._maxlen)
        if maxlen is None:
            return
        # Approximate like MAXLEN ~: trim in chunks so the list shift is amortised.
        if len(st.ids) > maxlen + max(1, maxlen // 10):
            excess = len(st.ids) - maxlen
            journal = self._journals.get(name)
            if journal is not None:
                for entry_id, _ in st.entries[:excess]:
                    journal.forget(entry_id)
            del st.ids[:excess]
            del st.entries[:excess]

    async def publish(self, stream: str, event: Event) -> str:
        if self._closed:
            raise BusError("bus is closed")
        data = encode(event)
        st = self._stream(stream)
        sid = self._next_id(st)
        st.last = sid
        entry_id = format_id(sid)
        journal = self._journals.get(stream)
        if journal is not None:
            journal.append(entry_id, data)  # before anyone can read (and ack) it
        st.ids.append(sid)
        st.entries.append((entry_id, data))
        self._trim(stream, st)
        st.wakeup.set()
        st.wakeup = asyncio.Event()
        return entry_id

    async def _wait(self, st: _Stream, deadline: float, waiter: asyncio.Event) -> bool:
        """Wait for a publish until `deadline`; False on timeout or when closed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._closed:
            return False
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands as the
            # waiter fires, and the reader's task then never ends.
            async with asyncio.timeout(remaining):
                await waiter.wait()
        except TimeoutError:
            return False
        return not self._closed

    async def read(
        self, stream: str, after: str = "$", *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        st = self._stream(stream)
        start = st.last if after == "$" else parse_id(after)
        deadline = time.monotonic() + block
        while True:
            waiter = st.wakeup
            i = bisect.bisect_right(st.ids, start)
            if i < len(st.ids):
                return st.entries[i : i + count]
            if not await self._wait(st, deadline, waiter):
                return []

    async def last_id(self, stream: str) -> str:
        st = self._streams.get(stream)
        return format_id(st.last) if st else "0-0"

    def _entry(self, st: _Stream, sid: StreamID) -> Entry | None:
        i = bisect.bisect_left(st.ids, sid)
        return st.entries[i] if i < len(st.ids) and st.ids[i] == sid else None

    async def read_group(
        self, stream: str, group: str, consumer: str, *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        st = self._stream(stream)
        g = st.groups.get(group)
        if g is None:
            g = st.groups[group] = _Group()
        mine = g.pending.setdefault(consumer, {})
        key = (stream, group, consumer)

        replay_from = self._replay.get(key, (0, 0))
        if replay_from is not None:
            batch: list[Entry] = []
            gone: list[StreamID] = []
            for sid in mine:
                if sid <= replay_from:
                    continue
                entry = self._entry(st, sid)
                if entry is None:
                    gone.append(sid)  # trimmed: nothing left to deliver
                    continue
                batch.append(entry)
                if len(batch) >= count:
                    break
            for sid in gone:
                del mine[sid]
                g.owner.pop(sid, None)
            if batch:
                self._replay[key] = parse_id(batch[-1][0])
                return batch
            self._replay[key] = None

        deadline = time.monotonic() + block
        while True:
            waiter = st.wakeup
            i = bisect.bisect_right(st.ids, g.cursor)
            if i < len(st.ids):
                batch = st.entries[i : i + count]
                for sid in st.ids[i : i + len(batch)]:
                    mine[sid] = None
                    g.owner[sid] = consumer
                g.cursor = st.ids[i + len(batch) - 1]
                return batch
            if not await self._wait(st, deadline, waiter):
                return []

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        st = self._streams.get(stream)
        g = st.groups.get(group) if st else None
        if st is None or g is None:
            return 0
        done = []
        for entry_id in ids:
            sid = parse_id(entry_id)
            consumer = g.owner.pop(sid, None)
            if consumer is not None:
                g.pending[consumer].pop(sid, None)
                done.append(entry_id)
        journal = self._journals.get(stream)
        if journal is not None:
            journal.ack(group, set(st.groups), done)
        return len(done)

    async def replay_pending(self, stream: str, group: str, consumer: str) -> None:
        self._replay[(stream, group, consumer)] = (0, 0)

    async def close(self) -> None:
        # Wake blocked readers so they return instead of waiting out their timeout.
        self._closed = True
        for st in self._streams.values():
            st.wakeup.set()
        for journal in self._journals.values():
            journal.close()


# --- Redis ------------------------------------------------------------------------------


def _entries(resp: Any) -> list[Entry]:
    """Normalise XREAD/XREADGROUP replies for one stream across redis-py's reply shapes."""
    if not resp:
        return []
    # RESP2: [[stream, entries]]; RESP3: {stream: entries} or {stream: [entries]}.
    value = next(iter(resp.values())) if isinstance(resp, dict) else resp[0][1]
    if value and isinstance(value[0], list):
        value = value[0]
    out: list[Entry] = []
    for entry_id, fields in value or ():
        if entry_id is None:
            continue
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        data = (fields or {}).get(FIELD)
        if data is None and fields:
            data = fields.get(FIELD.decode())
        out.append((eid, data if data is not None else b""))
    return out


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_busygroup(exc: Exception) -> bool:
    return str(exc).startswith("BUSYGROUP")


def redis_client(url: str, *, timeout: float = REDIS_TIMEOUT, block: float = 0.0) -> Redis:
    """A redis-py client whose every call is bounded: connecting within `timeout` seconds,
    each reply within `timeout` beyond the longest blocking read it makes (`block`). Past
    either, redis-py raises its `TimeoutError` (a `RedisError`, so an outage) and drops the
    connection. redis-py itself waits for ever by default: make redis-py clients here."""
    from redis.asyncio import Redis

    return Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=block + timeout)


class RedisBus(EventBus):
    """Redis Streams: `XADD MAXLEN ~`, `XREAD BLOCK`, consumer groups with `XREADGROUP`.

    Blocking reads are capped at `max_block` seconds; callers loop anyway. They may go
    through a client of their own (`blocking`) whose socket timeout covers that wait, so
    that every other call keeps the short one (`from_url` makes both).

    Group reads also keep the group whole (Redis >= 6.2): entries another consumer has held
    pending for `claim_idle` seconds are claimed (XAUTOCLAIM, scanned every `claim_idle / 4`)
    and returned like this consumer's own pending ones; and a stream published without a cap
    (the usage stream, `REDIS_STREAM_MAXLEN`) is trimmed every `trim_interval` seconds up to
    the oldest entry some group still has pending or has not been delivered yet.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        maxlen: int = DEFAULT_MAXLEN,
        stream_maxlen: Mapping[str, int | None] | None = None,
        owns_client: bool = False,
        max_block: float = MAX_BLOCK,
        blocking: Redis | None = None,
        claim_idle: float = CLAIM_IDLE,
        trim_interval: float = TRIM_INTERVAL,
    ):
        self._redis = redis
        self._blocking = blocking if blocking is not None else redis
        self.maxlen = maxlen
        self.stream_maxlen = redis_stream_maxlen_of(stream_maxlen)
        self._owns_client = owns_client
        self._max_block = max_block
        self.claim_idle = claim_idle
        self.trim_interval = trim_interval
        self._groups: set[tuple[str, str]] = set()
        self._replay: dict[tuple[str, str, str], str | None] = {}
        # (stream, group, consumer) -> XAUTOCLAIM cursor of a scan under way, and when
        # (monotonic) the next scan is due.
        self._claim_cursor: dict[tuple[str, str, str], str] = {}
        self._claim_due: dict[tuple[str, str, str], float] = {}
        self._trim_due: dict[str, float] = {}  # stream -> when its next trim is due

    @classmethod
    def from_url(cls, url: str, *, timeout: float = REDIS_TIMEOUT, **kwargs: Any) -> RedisBus:
        """A bus on clients of its own (see `redis_client`; `timeout` in seconds)."""
        block = kwargs.get("max_block", MAX_BLOCK)
        return cls(
            redis_client(url, timeout=timeout),
            blocking=redis_client(url, timeout=timeout, block=block),
            owns_client=True,
            **kwargs,
        )

    @property
    def redis(self) -> Redis:
        return self._redis

    def _block_ms(self, block: float) -> int | None:
        if block <= 0:
            return None  # no BLOCK at all: BLOCK 0 would mean "forever"
        return max(1, int(min(block, self._max_block) * 1000))

    async def publish(self, stream: str, event: Event) -> str:
        maxlen = self.stream_maxlen.get(stream, self.maxlen)
        entry_id = await self._redis.xadd(stream, {FIELD: encode(event)}, maxlen=maxlen, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def read(
        self, stream: str, after: str = "$", *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        block_ms = self._block_ms(block)
        client = self._redis if block_ms is None else self._blocking
        resp = await client.xread({stream: after}, count=count, block=block_ms)
        return _entries(resp)

    async def last_id(self, stream: str) -> str:
        from redis.exceptions import ResponseError

        try:
            info = await self._redis.xinfo_stream(stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return "0-0"
            raise
        last = info.get("last-generated-id") or info.get(b"last-generated-id") or b"0-0"
        return last.decode() if isinstance(last, bytes) else str(last)

    async def _ensure_group(self, stream: str, group: str) -> None:
        if (stream, group) in self._groups:
            return
        from redis.exceptions import ResponseError

        try:
            # From the start: events published before the first consumer ran are not lost.
            await self._redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if not _is_busygroup(exc):
                raise
        self._groups.add((stream, group))

    async def read_group(
        self, stream: str, group: str, consumer: str, *, block: float = 1.0, count: int = 100
    ) -> list[Entry]:
        from redis.exceptions import ResponseError

        await self._ensure_group(stream, group)
        try:
            return await self._read_group(stream, group, consumer, block=block, count=count)
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
        # The stream was deleted under us (e.g. a Redis restarted without persistence):
        # create the group again rather than failing until this process restarts.
        self._groups.discard((stream, group))
        self._claim_cursor.pop((stream, group, consumer), None)
        await self._ensure_group(stream, group)
        return await self._read_group(stream, group, consumer, block=block, count=count)

    async def _read_group(
        self, stream: str, group: str, consumer: str, *, block: float, count: int
    ) -> list[Entry]:
        key = (stream, group, consumer)
        replay_from = self._replay.get(key, "0")
        while replay_from is not None:
            # An explicit id reads this consumer's pending entries (its PEL), after that id.
            resp = await self._redis.xreadgroup(group, consumer, {stream: replay_from}, count=count)
            entries = _entries(resp)
            if not entries:
                self._replay[key] = replay_from = None
                break
            self._replay[key] = replay_from = entries[-1][0]
            batch = [e for e in entries if e[1]]
            gone = [e[0] for e in entries if not e[1]]
            if gone:
                # Trimmed before it was processed: the data is gone, so do not keep it pending.
                log.warning("bus: %d pending entries of %s/%s were trimmed", len(gone), stream, group)
                await self._redis.xack(stream, group, *gone)
            if batch:
                return batch
        claimed = await self._maintain(stream, group, consumer, count)
        if claimed:
            return claimed
        block_ms = self._block_ms(block)
        client = self._redis if block_ms is None else self._blocking
        resp = await client.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        return _entries(resp)

    async def _maintain(self, stream: str, group: str, consumer: str, count: int) -> list[Entry]:
        """Claim what dead consumers left pending, and trim the stream behind its groups,
        when due. A failure here (other than a lost group, which `read_group` repairs) is
        logged and skipped: it must never stop the consumer from reading new entries."""
        from redis.exceptions import ResponseError

        claimed: list[Entry] = []
        try:
            claimed = await self._claim(stream, group, consumer, count)
            if self.stream_maxlen.get(stream, self.maxlen) is None:
                await self._trim_behind_groups(stream)
        except ResponseError as exc:
            if str(exc).startswith("NOGROUP"):
                raise
            # e.g. a Redis older than 6.2 (no XAUTOCLAIM, no MINID): tried again when next due
            log.warning("bus: maintaining %s/%s failed: %s", stream, group, exc)
        return claimed

    async def _claim(self, stream: str, group: str, consumer: str, count: int) -> list[Entry]:
        """Entries of the group pending for longer than `claim_idle`, now this consumer's.

        One scan of the group's pending entries every `claim_idle / 4` seconds, continued
        over successive calls while it finds some (each call returns at most `count`).
        """
        key = (stream, group, consumer)
        cursor = self._claim_cursor.get(key)
        if cursor is None:  # no scan under way: start one if due
            if time.monotonic() < self._claim_due.get(key, 0.0):
                return []
            cursor = "0-0"
        min_idle_ms = max(1, int(self.claim_idle * 1000))
        while True:
            resp = await self._redis.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id=cursor, count=count
            )
            cursor = _str(resp[0])
            entries = _entries([[stream, resp[1]]])
            # Redis 7 drops entries deleted (trimmed) meanwhile from the pending list itself and
            # names them apart; 6.2 returns them without data, still pending.
            deleted = len(resp[2]) if len(resp) > 2 else 0
            gone = [e[0] for e in entries if not e[1]]
            if gone:
                await self._redis.xack(stream, group, *gone)
            if deleted or gone:
                log.warning(
                    "bus: %d pending entries of %s/%s were trimmed", deleted + len(gone), stream, group
                )
            batch = [e for e in entries if e[1]]
            if cursor == "0-0":  # scan complete: the next one when due
                self._claim_cursor.pop(key, None)
                self._claim_due[key] = time.monotonic() + self.claim_idle / 4
            else:
                self._claim_cursor[key] = cursor
            if batch:
                log.warning(
                    "bus: %s claimed %d entries of %s/%s left pending by another consumer",
                    consumer, len(batch), stream, group,
                )  # fmt: skip
                return batch
            if cursor == "0-0":
                return []

    async def _trim_behind_groups(self, stream: str) -> None:
        """Drop the entries every group reading `stream` is done with, when due.

        The floor is, over all groups, the oldest of: the smallest pending id, and the last
        id delivered (everything after it is still to be delivered). Both only move forward
        (entries become pending only when delivered past the last id, and claims keep ids),
        so a floor read a moment ago is still safe when XTRIM runs. `MINID ~` removes whole
        stream nodes only, entries strictly below the floor.
        """
        now = time.monotonic()
        if now < self._trim_due.get(stream, 0.0):
            return
        self._trim_due[stream] = now + self.trim_interval
        floor: StreamID | None = None
        for info in await self._redis.xinfo_groups(stream):
            bound = parse_id(_str(info["last-delivered-id"]))
            if int(info["pending"]):
                oldest = (await self._redis.xpending(stream, info["name"])).get("min")
                if oldest is not None:
                    bound = min(bound, parse_id(_str(oldest)))
            floor = bound if floor is None else min(floor, bound)
        if floor is None or floor == (0, 0):
            return
        minid = format_id(floor)
        while await self._redis.xtrim(stream, minid=minid, approximate=True, limit=_TRIM_CHUNK):
            pass

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        if not ids:
            return 0
        return int(await self._redis.xack(stream, group, *ids))

    async def replay_pending(self, stream: str, group: str, consumer: str) -> None:
        self._replay[(stream, group, consumer)] = "0"

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()
            if self._blocking is not self._redis:
                await self._blocking.aclose()


# --- over HTTP --------------------------------------------------------------------------


class HttpPublisher(Publisher):
    """Publishes through the server's internal bus endpoint (embedded mode, no Redis).

    One shared `httpx.AsyncClient` (keep-alive) for every event.
    """

    def __init__(
        self,
        bus_url: str,
        token: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = 5.0,
    ):
        if not token:
            raise BusConfigError("HttpPublisher needs the internal token (TOKENMILL_INTERNAL_TOKEN)")
        self._base = bus_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout)

    async def publish(self, stream: str, event: Event) -> str:
        url = f"{self._base}/{urllib.parse.quote(stream, safe=':')}"
        try:
            resp = await self._client.post(url, content=encode(event), headers=self._headers)
        except httpx.HTTPError as exc:
            raise BusPublishError(f"cannot reach the bus endpoint {url}: {exc!r}") from exc
        if not resp.is_success:
            raise BusPublishError(f"bus endpoint {url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return str(resp.json()["id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BusPublishError(f"bus endpoint {url} answered without an id: {resp.text[:300]}") from exc

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# --- factories --------------------------------------------------------------------------


def make_bus(settings: Settings, *, host: bool = False, **kwargs: Any) -> EventBus:
    """A bus: Redis when REDIS_URL is set, else in memory; the one a server hosts (`host`)
    keeps its usage events in a journal under HOME/bus until the ledger has them.

    `kwargs` go to the constructor (`maxlen`, `stream_maxlen`).
    """
    if settings.redis_url:
        return RedisBus.from_url(settings.redis_url, timeout=settings.redis_timeout_seconds, **kwargs)
    return MemoryBus(journal_dir=settings.home_dir / "bus" if host else None, **kwargs)


def make_publisher(settings: Settings) -> Publisher:
    """How a worker publishes: Redis directly, else the server's internal endpoint."""
    if settings.redis_url:
        return RedisBus.from_url(settings.redis_url, timeout=settings.redis_timeout_seconds)
    if settings.bus_url:
        token = settings.worker_credential  # the worker token: heartbeats and KV events only
        if not token:
            raise BusConfigError(
                "TOKENMILL_BUS_URL is set but neither TOKENMILL_WORKER_TOKEN nor TOKENMILL_INTERNAL_TOKEN is"
            )
        return HttpPublisher(settings.bus_url, token)
    raise BusConfigError(
        "no event bus configured: set REDIS_URL, or TOKENMILL_BUS_URL (with TOKENMILL_INTERNAL_TOKEN)"
        " to publish through a server's internal endpoint"
    )
