"""The live workers, as their events on the bus describe them.

Gateways (routing) and the autoscaler (reconciling) both keep one of these tables, fed
from the same `WORKERS` stream, so they agree on which workers exist. A worker is live
while its heartbeats keep coming: one silent for `timeout` seconds (killed, hung, cut off
from the network) stops counting at once, whether or not it ever said goodbye.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.protocol import Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent


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
    ttft_p95: float | None = None
    draining: bool = False
    inflight: int = 0  # requests this gateway replica sent and has not seen finish
    adapters: list[str] = field(default_factory=list)

    @property
    def load(self) -> int:
        # Our own in-flight count reacts at once; the heartbeat's figures lag by up to a beat.
        return max(self.running + self.waiting, self.inflight)


class WorkerTable:
    """Workers by id, from announce/heartbeat/departure events."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.workers: dict[str, WorkerState] = {}

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
            state.ttft_p95, state.adapters = ev.ttft_p95, ev.adapters
            state.draining = ev.draining
        elif isinstance(ev, WorkerAnnounce):
            state.draining = False

    def alive(self, worker: WorkerState, now: float | None = None) -> bool:
        return worker.seen >= (time.monotonic() if now is None else now) - self.timeout

    def live(self, deployment_id: str) -> list[WorkerState]:
        """Workers of the deployment that answer heartbeats and take new requests."""
        now = time.monotonic()
        return [
            w
            for w in self.workers.values()
            if w.deployment_id == deployment_id and self.alive(w, now) and not w.draining
        ]

    def silent(self) -> list[WorkerState]:
        """Workers whose heartbeats stopped without a goodbye."""
        now = time.monotonic()
        return [w for w in self.workers.values() if not self.alive(w, now)]
