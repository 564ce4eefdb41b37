"""The reconciler: desired deployments (the control plane's) against live workers (the bus's).

Every `interval` it reads the deployments that are not stopped, samples each one's load from its
workers' heartbeats (plus requests that gateways hold for a deployment with no worker),
asks the policy for a replica count, and has the provider make it so. Workers silent for
the heartbeat timeout (judged on evidence: see tokenmill.fleet) are replaced, and their
departure is announced on the bus for them (`lost`, at their last heartbeat), which closes
their lifetime; deployments that were stopped or deleted lose their workers, and those of a
suspended organisation are held at zero replicas (to come back when it resumes). Only the
holder of the lease acts; the others keep sampling, so a new leader starts with the same
history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from autoscaler.leader import Lease
from autoscaler.policy import Decision, PolicyConfig, PolicyState, Sample, decide
from autoscaler.providers import Provider, WorkerSpec
from control_plane.catalog.models import STOPPED, SUSPENDED, Deployment, Model
from tokenmill.bus import EventBus
from tokenmill.fleet import WorkerTable
from tokenmill.protocol import DEMAND, WORKERS, Demand, WorkerDeparture
from tokenmill.spool import OUTAGE_ERRORS
from tokenmill.tasks import Background, tail

log = logging.getLogger("tokenmill.autoscaler")

# A request counts as waiting for this long after its gateway last said so (it says so
# about once a second while it waits).
DEMAND_TTL = 3.0

# The deployment's `autoscaling` settings (control_plane.catalog.schemas.Autoscaling) by policy field.
_SETTING = {
    "target_concurrency": "target_concurrency",
    "target_ttft": "target_ttft_seconds",
    "stable_window": "stable_window_seconds",
    "panic_window": "panic_window_seconds",
    "scale_down_cooldown": "scale_down_cooldown_seconds",
    "scale_to_zero_grace": "scale_to_zero_grace_seconds",
}


@dataclass(slots=True)
class Desired:
    """One deployment as the control plane wants it."""

    spec: WorkerSpec
    config: PolicyConfig
    # Its organisation is suspended: zero replicas, whatever the load (the policy's
    # cooldowns and panic mode would otherwise keep workers it must not run).
    held: bool = False


def policy_config(dep: Deployment) -> PolicyConfig:
    settings: dict[str, Any] = (dep.config or {}).get("autoscaling") or {}
    names = {f.name for f in fields(PolicyConfig)}
    given = {k: settings[v] for k, v in _SETTING.items() if k in names and settings.get(v) is not None}
    return PolicyConfig(min_replicas=dep.min_replicas, max_replicas=dep.max_replicas, **given)


async def desired_deployments(sessionmaker: async_sessionmaker[AsyncSession]) -> dict[str, Desired]:
    async with sessionmaker() as session:
        rows = await session.execute(
            select(Deployment, Model.source)
            .join(Model, Model.id == Deployment.model_id)
            .where(Deployment.status != STOPPED)
        )
        return {
            dep.id: Desired(
                WorkerSpec(
                    deployment_id=dep.id,
                    name=dep.name,
                    model=source,
                    kind=dep.kind,
                    gpu_type=dep.gpu_type,
                    engine=dep.engine,
                    engine_args=dict(dep.engine_args or {}),
                    gpus=dep.gpus_per_replica,
                    options=dict((dep.config or {}).get("resources") or {}),
                ),
                policy_config(dep),
                held=dep.status == SUSPENDED,
            )
            for dep, source in rows
        }


class Reconciler(Background):
    name = "autoscaler"

    def __init__(
        self,
        bus: EventBus,
        sessionmaker: async_sessionmaker[AsyncSession],
        provider: Provider,
        lease: Lease,
        *,
        interval: float,
        worker_timeout: float,
    ) -> None:
        super().__init__()
        self.bus = bus
        self.sessionmaker = sessionmaker
        self.provider = provider
        self.lease = lease
        self.interval = interval
        self.table = WorkerTable(worker_timeout)
        self.samples: dict[str, deque[Sample]] = {}
        self.states: dict[str, PolicyState] = {}
        self.decisions: dict[str, Decision] = {}  # the latest, for status pages and tests
        self.demand: dict[str, dict[str, float]] = {}  # deployment -> request id -> monotonic
        self.departures: list[WorkerDeparture] = []  # lost workers to announce on the bus
        self.started = time.monotonic()

    async def run(self) -> None:
        demand = msgspec.json.Decoder(Demand)
        await asyncio.gather(
            self.table.follow(self.bus, name=self.name),
            tail(self.bus, DEMAND, lambda raw: self.wanted(demand.decode(raw)), name=self.name),
            self._loop(),
        )

    async def stop(self) -> None:
        await super().stop()
        await self.lease.release()

    def wanted(self, ev: Demand) -> None:
        self.demand.setdefault(ev.deployment_id, {})[ev.request_id] = time.monotonic()

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile failed; retrying in %.1fs", self.interval)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def tick(self) -> None:
        desired = await desired_deployments(self.sessionmaker)
        now = time.monotonic()
        for dep_id, want in desired.items():
            self._sample(dep_id, want.config, now)
        if not await self.lease.hold():
            return
        for dep_id in set(await self.provider.managed()) - desired.keys():
            log.info("deployment %s is stopped or gone: removing its workers", dep_id)
            await self.provider.remove(dep_id)
            self.samples.pop(dep_id, None)
            self.states.pop(dep_id, None)
        for worker in self.table.silent():
            wanted = desired.get(worker.deployment_id) if worker.deployment_id else None
            if wanted is not None and not wanted.held:
                log.warning("worker %s stopped sending heartbeats: replacing it", worker.worker_id)
                await self.provider.replace(worker.deployment_id, worker.worker_id)
            self.table.workers.pop(worker.worker_id, None)
            # Said on its behalf (it never will, killed or cut off): every table drops it, and
            # its lifetime closes at its last heartbeat (what dedicated deployments bill).
            self.departures.append(
                WorkerDeparture(worker.worker_id, worker.deployment_id, ts=worker.sent, lost=True)
            )
        await self._announce_departures()
        for want in desired.values():
            try:
                await self._reconcile(want, now)
            except ValueError as exc:
                # One deployment the provider cannot build (a setting it needs is missing, a
                # GPU type it has no size for) must not hold up every other deployment.
                log.error("cannot reconcile deployment %s: %s", want.spec.deployment_id, exc)

    async def _announce_departures(self) -> None:
        """Publish the departures not published yet, oldest first; the rest wait for the next
        tick (the bus may be down)."""
        while self.departures:
            try:
                await self.bus.publish(WORKERS, self.departures[0])
            except OUTAGE_ERRORS as exc:
                log.warning(
                    "could not announce that worker %s is gone: %s", self.departures[0].worker_id, exc
                )
                return
            self.departures.pop(0)

    def _sample(self, dep_id: str, config: PolicyConfig, now: float) -> None:
        workers = [
            w for w in self.table.workers.values() if w.deployment_id == dep_id and self.table.alive(w, now)
        ]
        held = self.demand.get(dep_id, {})
        for request_id, seen in list(held.items()):
            if now - seen > DEMAND_TTL:
                del held[request_id]
        serving = [w for w in workers if not w.draining]
        ttfts = [w.ttft_p95 for w in workers if w.ttft_p95 is not None]
        sample = Sample(
            ts=now,
            running=sum(w.running for w in workers),
            waiting=sum(w.waiting for w in workers) + len(held),
            kv_usage=sum(w.kv_usage for w in serving) / len(serving) if serving else 0.0,
            ttft_p95=max(ttfts) if ttfts else None,
        )
        history = self.samples.setdefault(dep_id, deque())
        history.append(sample)
        while history and history[0].ts <= now - config.stable_window:
            history.popleft()

    async def _reconcile(self, want: Desired, now: float) -> None:
        dep_id = want.spec.deployment_id
        current = await self.provider.replicas(dep_id)
        state = self.states.get(dep_id, PolicyState())
        if want.held:
            decision = Decision(0, False, "organisation suspended", state)
        else:
            decision = decide(want.config, self.samples.get(dep_id, ()), current, state, now)
        self.states[dep_id] = decision.state
        self.decisions[dep_id] = decision
        if decision.desired != current:
            log.info("%s: %d -> %d replicas (%s)", want.spec.name, current, decision.desired, decision.reason)
        # The idlest workers go first when scaling down: the least to drain.
        victims = sorted(
            (w for w in self.table.workers.values() if w.deployment_id == dep_id),
            key=lambda w: (w.running + w.waiting, w.kv_usage),
        )
        await self.provider.scale(want.spec, decision.desired, [w.worker_id for w in victims])
