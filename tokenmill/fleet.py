"""The live workers, as their events on the bus describe them.

Gateways (routing), the autoscaler (reconciling) and the dashboard each keep one of these
tables, fed from the same `WORKERS` stream (`follow`), so they agree on which workers exist.
A worker is live while its heartbeats keep coming: one silent for `timeout` seconds (killed,
hung, cut off from the network) stops counting at once, whether or not it ever said goodbye.

Silence is judged on evidence from the worker's side only: time during which this process
could not have received a heartbeat is never held against a worker. The bus reader reports
each read that left it caught up (`caught_up(at)`: everything published before `at` has
been applied), and silence is counted up to the last such moment, not up to "now":

- While the reader cannot read, nobody turns silent: Redis stopped, unreachable or slow, or
  our own event loop stalled (a CPU-heavy request, a long GC), during which heartbeats sit
  unread in a socket or, in the embedded mode where this loop hosts the bus, cannot even be
  published.
- Caught-up reads further apart than the reader's blocking wait plus `stall` seconds mean
  one of those stalls happened. Every worker then gets a full `timeout` window again, from
  the stall's end: its heartbeats may have been lost with the outage, and the next one is
  about to come.

A worker that really stopped is still found within `timeout` of the moment we could have
heard from it, plus up to one blocking read (`READ_BLOCK`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import msgspec

from tokenmill.bus import EventBus
from tokenmill.protocol import WORKERS, Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.tasks import tail

# How long `follow`'s reads block when nothing comes (`tail`'s wait).
READ_BLOCK = 1.0


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
    sent: float = 0.0  # the worker's own (wall-clock) time of its last event

    @property
    def load(self) -> int:
        # Our own in-flight count reacts at once; the heartbeat's figures lag by up to a beat.
        return max(self.running + self.waiting, self.inflight)


class WorkerTable:
    """Workers by id, from announce/heartbeat/departure events."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.workers: dict[str, WorkerState] = {}
        # Caught-up reads further apart than their blocking wait plus this are a stall of this
        # process, not silence of the workers. Shorter lags count as silence: a healthy
        # worker's heartbeats still come well within `timeout`.
        self.stall = timeout / 4
        # Monotonic end of the last stall: every worker counts as heard from then.
        self.grace_from = -math.inf
        # The last moment the bus reader was caught up; None when no reader reports (then
        # silence counts up to now).
        self.heard_until: float | None = None
        self.read_block = READ_BLOCK

    def apply(self, ev: WorkerEvent) -> None:
        if isinstance(ev, WorkerDeparture):
            self.workers.pop(ev.worker_id, None)
            return
        state = self.workers.get(ev.worker_id)
        if state is None:
            state = WorkerState(ev.worker_id, ev.deployment_id, ev.address, ev.model, time.monotonic())
            self.workers[ev.worker_id] = state
        state.seen = time.monotonic()
        state.sent = ev.ts or time.time()
        state.address = ev.address
        if isinstance(ev, Heartbeat):
            state.running, state.waiting, state.kv_usage = ev.running, ev.waiting, ev.kv_usage
            state.ttft_p95, state.adapters = ev.ttft_p95, ev.adapters
            state.draining = ev.draining
        elif isinstance(ev, WorkerAnnounce):
            state.draining = False

    # --- evidence -------------------------------------------------------------------------

    def caught_up(self, at: float) -> None:
        """The bus reader has applied everything published before `at` (monotonic)."""
        if self.heard_until is not None and at - self.heard_until > self.read_block + self.stall:
            self.grace_from = max(self.grace_from, at)  # the reader (or our loop) was stalled
        self.heard_until = at if self.heard_until is None else max(self.heard_until, at)

    async def follow(self, bus: EventBus, *, name: str) -> None:
        """Apply the `WORKERS` stream from now on, for ever, reporting what it heard."""
        decoder = msgspec.json.Decoder(WorkerEvent)
        self.read_block = READ_BLOCK
        await tail(
            bus,
            WORKERS,
            lambda raw: self.apply(decoder.decode(raw)),
            name=name,
            block=READ_BLOCK,
            caught_up=self.caught_up,
        )

    def silence(self, worker: WorkerState, now: float | None = None) -> float:
        """Seconds the worker has been silent while we could have heard from it."""
        now = time.monotonic() if now is None else now
        until = now if self.heard_until is None else min(now, self.heard_until)
        return until - max(worker.seen, self.grace_from)

    # --- queries --------------------------------------------------------------------------

    def alive(self, worker: WorkerState, now: float | None = None) -> bool:
        return self.silence(worker, now) <= self.timeout

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
