"""The gateway's view of the worker fleet, built from heartbeats on the bus.

Every replica tails the same stream, so all replicas see the same workers. A worker whose
heartbeats stop for `worker_timeout_seconds` is no longer routed to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import msgspec

from tokenmill.bus import EventBus
from tokenmill.protocol import WORKERS, Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.tasks import Background

log = logging.getLogger("tokenmill.gateway.fleet")


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    deployment_id: str | None
    address: str
    model: str
    seen: float  # monotonic time of the last event
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    draining: bool = False
    inflight: int = 0  # requests this replica sent and has not seen finish

    @property
    def load(self) -> int:
        # Our own in-flight count reacts at once; the heartbeat's figures lag by up to a beat.
        return max(self.running + self.waiting, self.inflight)


class FleetView(Background):
    name = "fleet-view"

    def __init__(self, bus: EventBus, *, timeout: float) -> None:
        super().__init__()
        self.bus = bus
        self.timeout = timeout
        self.workers: dict[str, WorkerState] = {}
        self._changed = asyncio.Event()

    async def run(self) -> None:
        decoder = msgspec.json.Decoder(WorkerEvent)
        after = await self.bus.last_id(WORKERS)
        while True:
            try:
                for entry_id, raw in await self.bus.read(WORKERS, after, block=1.0):
                    after = entry_id
                    self.apply(decoder.decode(raw))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fleet view: reading the workers stream failed; retrying")
                await asyncio.sleep(1.0)

    def apply(self, ev: WorkerEvent) -> None:
        if isinstance(ev, WorkerDeparture):
            self.workers.pop(ev.worker_id, None)
            return
        state = self.workers.get(ev.worker_id)
        if state is None:
            state = WorkerState(ev.worker_id, ev.deployment_id, ev.address, ev.model, time.monotonic())
            self.workers[ev.worker_id] = state
        state.seen = time.monotonic()
        state.address = ev.address
        if isinstance(ev, Heartbeat):
            state.running, state.waiting, state.kv_usage = ev.running, ev.waiting, ev.kv_usage
            state.draining = ev.draining
        elif isinstance(ev, WorkerAnnounce):
            state.draining = False
        self._changed.set()

    def live(self, deployment_id: str) -> list[WorkerState]:
        cutoff = time.monotonic() - self.timeout
        return [
            w
            for w in self.workers.values()
            if w.deployment_id == deployment_id and w.seen >= cutoff and not w.draining
        ]

    def pick(self, deployment_id: str, exclude: Collection[str] = ()) -> WorkerState | None:
        candidates = [w for w in self.live(deployment_id) if w.worker_id not in exclude]
        return min(candidates, key=lambda w: (w.load, w.kv_usage), default=None)

    def forget(self, worker_id: str) -> None:
        """Drop a worker that failed a request; its next heartbeat brings it back."""
        self.workers.pop(worker_id, None)

    async def wait_for(
        self, deployment_id: str, wait: float, exclude: Collection[str] = ()
    ) -> WorkerState | None:
        deadline = time.monotonic() + wait
        while (worker := self.pick(deployment_id, exclude)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        return worker
