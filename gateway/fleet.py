"""The gateway's view of the worker fleet, built from heartbeats and KV events on the bus.

Every replica tails the same streams, so all replicas see the same workers and route alike.
A worker whose heartbeats stop for `worker_timeout_seconds` is no longer routed to. KV
events say which prompt blocks each worker holds in its prefix cache: a request goes where
the longest prefix of its prompt already is, unless that worker is much busier than the
least loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import msgspec

from tokenmill.bus import EventBus
from tokenmill.protocol import (
    KV,
    WORKERS,
    Heartbeat,
    KvEvents,
    WorkerAnnounce,
    WorkerDeparture,
    WorkerEvent,
)
from tokenmill.tasks import Background

log = logging.getLogger("tokenmill.gateway.fleet")

# Requests of extra load a worker may carry, beyond the least loaded, and still be chosen for
# its cached prefix: past this, waiting in its queue costs more than recomputing the prefix.
IMBALANCE = 4


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
        self.cached: dict[str, set[str]] = {}  # worker id -> hex hashes of its cached blocks
        self._changed = asyncio.Event()

    async def run(self) -> None:
        workers = msgspec.json.Decoder(WorkerEvent)
        kv = msgspec.json.Decoder(KvEvents)
        await asyncio.gather(
            self._tail(WORKERS, lambda raw: self.apply(workers.decode(raw))),
            self._tail(KV, lambda raw: self.apply_kv(kv.decode(raw))),
        )

    async def _tail(self, stream: str, apply: Callable[[bytes], None]) -> None:
        after = await self.bus.last_id(stream)
        while True:
            try:
                for entry_id, raw in await self.bus.read(stream, after, block=1.0):
                    after = entry_id
                    apply(raw)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fleet view: reading %s failed; retrying", stream)
                await asyncio.sleep(1.0)

    def apply_kv(self, ev: KvEvents) -> None:
        blocks = self.cached.setdefault(ev.worker_id, set())
        for op in ev.ops:
            if op.op == "stored":
                blocks.update(op.hashes)
            else:
                blocks.difference_update(op.hashes)

    def apply(self, ev: WorkerEvent) -> None:
        if isinstance(ev, WorkerDeparture):
            self.workers.pop(ev.worker_id, None)
            self.cached.pop(ev.worker_id, None)
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

    def pick(
        self, deployment_id: str, exclude: Collection[str] = (), hashes: Sequence[str] = ()
    ) -> WorkerState | None:
        """The worker holding the longest cached prefix of `hashes` (the prompt's block
        hashes) among those not much busier than the least loaded; ties go to the idler."""
        candidates = [w for w in self.live(deployment_id) if w.worker_id not in exclude]
        if not candidates:
            return None
        least = min(w.load for w in candidates)
        eligible = [w for w in candidates if w.load <= least + IMBALANCE]
        return max(eligible, key=lambda w: (self.overlap(w.worker_id, hashes), -w.load, -w.kv_usage))

    def overlap(self, worker_id: str, hashes: Sequence[str]) -> int:
        """How many leading blocks of the prompt the worker has cached (a prefix cache can
        only use an unbroken run from the start)."""
        blocks = self.cached.get(worker_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def forget(self, worker_id: str) -> None:
        """Drop a worker that failed a request; its next heartbeat brings it back."""
        self.workers.pop(worker_id, None)

    async def wait_for(
        self, deployment_id: str, wait: float, exclude: Collection[str] = (), hashes: Sequence[str] = ()
    ) -> WorkerState | None:
        deadline = time.monotonic() + wait
        while (worker := self.pick(deployment_id, exclude, hashes)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        return worker
