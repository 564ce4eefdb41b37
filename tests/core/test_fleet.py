"""Worker liveness judged on evidence (tokenmill/fleet.py): a stall of our own event loop or of
our bus reader is never a worker's silence, and a worker that really stopped is still found.

The table follows the real in-memory bus (the embedded mode's, where the stalled loop also
hosts the bus) with workers heartbeating as tasks; loop stalls are real (`time.sleep` on the
loop), a bus outage is a bus that refuses every call for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmill.bus import Entry, MemoryBus
from tokenmill.fleet import READ_BLOCK, WorkerTable
from tokenmill.protocol import WORKERS, Heartbeat

TIMEOUT = 0.6  # seconds of silence that make a worker silent
BEAT = 0.1


class Fleet:
    """Heartbeating workers (tasks) and a table following them on the bus."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self.table = WorkerTable(TIMEOUT)
        self.beating: dict[str, asyncio.Task[None]] = {}
        self.last_beat: dict[str, float] = {}  # worker -> monotonic time of its last heartbeat
        self.follower: asyncio.Task[None] | None = None

    async def _beat(self, worker_id: str) -> None:
        while True:
            with contextlib.suppress(ConnectionError):  # the bus may be down: skip this beat
                await self.bus.publish(WORKERS, Heartbeat(worker_id, "dep", f"http://{worker_id}", "m"))
                self.last_beat[worker_id] = time.monotonic()
            await asyncio.sleep(BEAT)

    def start(self, worker_id: str) -> None:
        self.beating[worker_id] = asyncio.create_task(self._beat(worker_id))

    def stop(self, worker_id: str) -> None:
        self.beating.pop(worker_id).cancel()

    async def until_known(self, *worker_ids: str) -> None:
        deadline = time.monotonic() + 5
        while not all(w in self.table.workers for w in worker_ids):
            assert time.monotonic() < deadline, self.table.workers
            await asyncio.sleep(0.01)

    def silent(self) -> set[str]:
        return {w.worker_id for w in self.table.silent()}


@contextlib.asynccontextmanager
async def fleet(bus: MemoryBus | None = None) -> AsyncIterator[Fleet]:
    f = Fleet(bus or MemoryBus())
    f.follower = asyncio.create_task(f.table.follow(f.bus, name="test"))
    try:
        yield f
    finally:
        for task in [*f.beating.values(), f.follower]:
            task.cancel()
        await asyncio.gather(*f.beating.values(), f.follower, return_exceptions=True)
        await f.bus.close()


async def test_a_stalled_event_loop_does_not_make_workers_silent() -> None:
    async with fleet() as f:
        f.start("a")
        f.start("b")
        await f.until_known("a", "b")
        await asyncio.sleep(0.3)
        # A CPU-heavy request holds the loop for more than three timeouts: no heartbeat could
        # even be published (this loop hosts the bus). Right after it, before the watchdog or
        # the reader has run (as a reconciler's tick may), nobody is silent.
        time.sleep(4 * TIMEOUT)  # noqa: ASYNC251 - the stall under test
        assert f.silent() == set()
        assert {w.worker_id for w in f.table.live("dep")} == {"a", "b"}
        # nor while the heartbeats come back one by one: b's publish failed in the stall, its
        # next heartbeat comes a while after a's
        f.stop("b")
        deadline = time.monotonic() + TIMEOUT / 2
        while time.monotonic() < deadline:
            assert f.silent() == set()
            await asyncio.sleep(0.02)
        f.start("b")
        deadline = time.monotonic() + 2 * TIMEOUT
        while time.monotonic() < deadline:
            assert f.silent() == set()
            await asyncio.sleep(0.02)


async def test_a_stalled_bus_reader_does_not_make_workers_silent() -> None:
    """Redis stopped for everyone: nothing can be published or read. Once it is back, the
    workers' heartbeats return one by one; none is held silent for the outage."""

    class Outage(MemoryBus):
        def __init__(self) -> None:
            super().__init__()
            self.down = False

        async def publish(self, stream: str, event: Any) -> str:
            if self.down:
                raise ConnectionError("Redis is stopped")
            return await super().publish(stream, event)

        async def read(self, stream: str, after: str = "$", **kw: Any) -> list[Entry]:
            if self.down:
                await asyncio.sleep(0.1)
                raise ConnectionError("Redis is stopped")
            return await super().read(stream, after, **kw)

    bus = Outage()
    async with fleet(bus) as f:
        f.start("a")
        f.start("b")
        await f.until_known("a", "b")
        bus.down = True
        deadline = time.monotonic() + 4 * TIMEOUT
        while time.monotonic() < deadline:  # while nothing can be read, nobody turns silent
            assert f.silent() == set()
            await asyncio.sleep(0.05)
        f.stop("b")  # b's first heartbeat after the outage comes late
        bus.down = False
        seen_a = f.table.workers["a"].seen
        while f.table.workers["a"].seen == seen_a:  # the reader is back
            assert f.silent() == set()
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + TIMEOUT / 2
        while time.monotonic() < deadline:
            assert f.silent() == set()
            await asyncio.sleep(0.02)
        f.start("b")
        await asyncio.sleep(TIMEOUT)
        assert f.silent() == set()


@pytest.mark.parametrize("stall_first", [False, True])
async def test_a_worker_that_really_stops_is_found_within_the_timeout(stall_first: bool) -> None:
    async with fleet() as f:
        f.start("a")
        f.start("b")
        await f.until_known("a", "b")
        if stall_first:  # a stall earlier on does not blind the table for good
            time.sleep(3 * TIMEOUT)  # noqa: ASYNC251 - a stall of our loop
            await asyncio.sleep(0.1)
        f.stop("b")
        stopped = f.last_beat["b"]
        while "b" not in f.silent():
            assert time.monotonic() - stopped < 2 * (TIMEOUT + READ_BLOCK), "b was never found silent"
            await asyncio.sleep(0.02)
        found = time.monotonic() - stopped
        assert found >= TIMEOUT  # not before its timeout
        assert f.silent() == {"b"}  # and a, which kept beating, is alive
