"""Long-running loops owned by a server process, and the one way to consume a bus stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from tokenmill.bus import Entry, EventBus

log = logging.getLogger("tokenmill.tasks")

# Entries `tail` reads at a time; a read returning fewer has caught up with the stream.
_TAIL_COUNT = 100


def cancels() -> int:
    """Cancellations requested of the running task and not yet taken back."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def honour_cancel(before: int) -> None:
    """Raise a cancellation that was requested but swallowed on the way (redis-py 8.x on
    Python 3.11 loses some that land as a command completes): a loop asked to stop stops at
    its next step instead of reading on for ever."""
    if cancels() > before:
        raise asyncio.CancelledError


class Background(ABC):
    """`start()` on app startup, `stop()` on shutdown; subclasses write `run()`."""

    name = "background"

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        # Cancel until it takes: redis-py (8.x, Python 3.11) can swallow a cancellation
        # that lands as a command completes, and the loop would then run on for ever.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", self.name, exc_info=task.exception())

    @abstractmethod
    async def run(self) -> None:
        """The loop; cancelled by `stop()`."""


async def tail(
    bus: EventBus,
    stream: str,
    apply: Callable[[bytes], None],
    *,
    name: str,
    block: float = 1.0,
    caught_up: Callable[[float], None] | None = None,
) -> None:
    """Apply every entry published to `stream` from now on, for ever (every replica sees all).

    Survives a bus outage. A Redis restarted without persistence has lost the stream, but
    new entries get time-based ids above the one we wait past, so reading goes on as before.
    `caught_up(t)` is called after each read that left nothing behind: every entry published
    before monotonic time `t` has been applied (what judging silence on evidence needs).
    """
    after: str | None = None
    before = cancels()
    while True:
        honour_cancel(before)
        try:
            if after is None:
                after = await bus.last_id(stream)
            started = time.monotonic()
            entries = await bus.read(stream, after, block=block, count=_TAIL_COUNT)
            for entry_id, raw in entries:
                after = entry_id
                try:
                    apply(raw)
                except Exception:
                    log.exception("%s: dropping an entry of %s it cannot apply", name, stream)
            if caught_up is not None and len(entries) < _TAIL_COUNT:
                caught_up(started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: reading %s failed (%s); retrying", name, stream, exc)
            await asyncio.sleep(1.0)


class GroupConsumer(Background):
    """Consumes a stream through a consumer group: at least once, acked after `handle`.

    A batch whose `handle` raises is handed back to the group and retried after a pause,
    so handlers must be idempotent (the ledger's unique request id, the workers table's
    upserts). A restart with the same consumer name resumes with its pending entries; what a
    consumer that died (under any name) left pending is claimed by a live one once idle past
    the bus's threshold (`RedisBus` claim_idle), and handled here like any other batch.
    """

    stream = ""
    group = ""
    count = 200

    def __init__(self, bus: EventBus, consumer: str) -> None:
        super().__init__()
        self.bus = bus
        self.consumer = consumer

    @abstractmethod
    async def handle(self, entries: list[Entry]) -> None:
        """Apply one batch; must be idempotent (a failed batch is delivered again)."""

    async def stop(self) -> None:
        """Stop the loop, then handle what has already arrived, so that events published just
        before a shutdown (a worker's departure, a last usage event) are not left waiting."""
        await super().stop()
        try:
            await self._consume(block=0.0)
        except Exception:
            log.warning("%s: final drain of %s failed; the group keeps it pending", self.name, self.stream)

    async def _consume(self, block: float) -> None:
        entries = await self.bus.read_group(
            self.stream, self.group, self.consumer, block=block, count=self.count
        )
        if entries:
            await self.handle(entries)
            await self.bus.ack(self.stream, self.group, *[i for i, _ in entries])

    async def run(self) -> None:
        before = cancels()
        while True:
            honour_cancel(before)
            try:
                await self._consume(block=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: consuming %s failed; retrying", self.name, self.stream)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.bus.replay_pending(self.stream, self.group, self.consumer)
