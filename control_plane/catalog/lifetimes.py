"""Worker lifetimes, recorded from the bus: what dedicated deployments are billed on."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.catalog.models import Deployment, Worker
from tokenmill.bus import Entry, EventBus
from tokenmill.db import utcnow
from tokenmill.protocol import WORKERS, Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.tasks import GroupConsumer


class WorkerLifetimes(GroupConsumer):
    """Records each worker's start and stop (what dedicated deployments are billed on).

    Last-seen times are written at most every few seconds per worker.
    """

    name = "worker-lifetimes"
    stream = WORKERS
    group = "control-plane-workers"

    def __init__(self, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], consumer: str) -> None:
        super().__init__(bus, consumer)
        self.sessionmaker = sessionmaker
        self._seen: dict[str, float] = {}
        self._decoder = msgspec.json.Decoder(WorkerEvent)

    async def handle(self, entries: list[Entry]) -> None:
        await self.apply([self._decoder.decode(raw) for _, raw in entries])

    async def apply(self, events: list[WorkerEvent]) -> None:
        async with self.sessionmaker() as session, session.begin():
            for ev in events:
                ts = datetime.fromtimestamp(ev.ts, UTC) if ev.ts else utcnow()
                if isinstance(ev, WorkerAnnounce | Heartbeat):
                    if isinstance(ev, Heartbeat) and ev.ts - self._seen.get(ev.worker_id, 0.0) < 5.0:
                        continue
                    self._seen[ev.worker_id] = ev.ts
                    worker = await session.get(Worker, ev.worker_id)
                    if worker is None:
                        dep = await _known_deployment(session, ev.deployment_id)
                        session.add(
                            Worker(
                                id=ev.worker_id,
                                deployment_id=dep.id if dep is not None else None,
                                address=ev.address,
                                model=ev.model,
                                gpu_type=getattr(ev, "gpu_type", None),
                                # What it holds as of now: a later change to the deployment
                                # applies to the workers started after it.
                                gpus=dep.gpus_per_replica if dep is not None else 0,
                                started_at=ts,
                                last_seen_at=ts,
                            )
                        )
                        await session.flush()
                    elif worker.stopped_at is None:
                        worker.last_seen_at = ts
                    elif _superseded(worker, ts):
                        # Declared lost, yet it speaks again (it was starved, not dead): it
                        # held its GPUs all along, so its lifetime goes on.
                        worker.stopped_at, worker.last_seen_at, worker.status = None, ts, "running"
                elif isinstance(ev, WorkerDeparture):
                    # A lost worker (declared gone by the reconciler) stops at its last
                    # heartbeat: no unseen time is billed, and none that was seen is dropped.
                    # Its own goodbye, later, overrides that guess.
                    self._seen.pop(ev.worker_id, None)
                    worker = await session.get(Worker, ev.worker_id)
                    if worker is not None and (
                        worker.stopped_at is None or (not ev.lost and _superseded(worker, ts))
                    ):
                        worker.stopped_at, worker.last_seen_at = ts, ts
                        worker.status = "lost" if ev.lost else "stopped"


def _superseded(worker: Worker, ts: datetime) -> bool:
    """Whether an event of the worker's own at `ts` shows it outlived a lost declaration."""
    return worker.status == "lost" and worker.stopped_at is not None and worker.stopped_at < ts


async def _known_deployment(session: AsyncSession, deployment_id: str | None) -> Deployment | None:
    # A worker started by hand may name a deployment this database does not know.
    return await session.get(Deployment, deployment_id) if deployment_id else None
