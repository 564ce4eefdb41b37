"""Long-running loops owned by a server process, and the one way to consume a bus stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod

from tokenmill.bus import Entry, EventBus

log = logging.getLogger("tokenmill.tasks")


class Background(ABC):
    """`start()` on app startup, `stop()` on shutdown; subclasses write `run()`."""

    name = "background"

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @abstractmethod
    async def run(self) -> None:
        """The loop; cancelled by `stop()`."""


class GroupConsumer(Background):
    """Consumes a stream through a consumer group: at least once, acked after `handle`.

    A batch whose `handle` raises is handed back to the group and retried after a pause,
    so handlers must be idempotent (the ledger's unique request id, the workers table's
    upserts). A restart with the same consumer name resumes with its pending entries.
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
        while True:
            try:
                await self._consume(block=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: consuming %s failed; retrying", self.name, self.stream)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.bus.replay_pending(self.stream, self.group, self.consumer)
