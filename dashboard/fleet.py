"""The fleet as the dashboard shows it: every worker's last heartbeat, from the bus.

The same table of live workers the gateways and the reconciler keep (`tokenmill.fleet`),
fed from the `WORKERS` stream from "now" on: a worker shows up with its next heartbeat
(within `heartbeat_seconds`), one silent for `timeout` seconds is shown as lost, and one
silent for much longer is forgotten (its lifetime stays in the workers table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.bus import EventBus
from tokenmill.fleet import WorkerTable
from tokenmill.tasks import Background

# A worker silent this many timeouts long leaves the table; shorter silences show as "lost".
FORGET_AFTER = 20


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """One worker as a page shows it."""

    worker_id: str
    deployment_id: str | None
    model: str
    running: int
    waiting: int  # the queue depth
    kv_usage: float  # 0..1
    adapters: tuple[str, ...]
    ttft_p95: float | None  # seconds
    live: bool
    draining: bool

    @property
    def state(self) -> str:
        if not self.live:
            return "lost"
        return "draining" if self.draining else "serving"


class FleetStatus(WorkerTable, Background):
    name = "dashboard-fleet"

    def __init__(self, bus: EventBus, *, timeout: float) -> None:
        WorkerTable.__init__(self, timeout)
        Background.__init__(self)
        self.bus = bus

    async def run(self) -> None:
        await self.follow(self.bus, name=self.name)

    def snapshot(self, deployment_ids: set[str] | None = None) -> list[LiveWorker]:
        """The workers (of `deployment_ids` only, when given), by deployment then id."""
        now = time.monotonic()
        for worker_id in [w for w, s in self.workers.items() if now - s.seen > FORGET_AFTER * self.timeout]:
            del self.workers[worker_id]
        out = [
            LiveWorker(
                worker_id=w.worker_id,
                deployment_id=w.deployment_id,
                model=w.model,
                running=w.running,
                waiting=w.waiting,
                kv_usage=w.kv_usage,
                adapters=tuple(w.adapters),
                ttft_p95=w.ttft_p95,
                live=self.alive(w, now),
                draining=w.draining,
            )
            for w in self.workers.values()
            if deployment_ids is None or w.deployment_id in deployment_ids
        ]
        return sorted(out, key=lambda w: (w.deployment_id or "", w.worker_id))
