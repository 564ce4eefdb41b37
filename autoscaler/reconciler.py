"""The reconciler: desired deployments (the control plane's) against live workers (the bus's).

Every `interval` it reads the deployments that are not stopped, samples each one's load from its
workers' heartbeats (plus requests that gateways hold for a deployment with no worker), with
the rate at which requests arrive at them (from the counters heartbeats carry: autoscaler/load.py),
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
from collections.abc import Awaitable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from autoscaler.leader import Lease
from autoscaler.load import ArrivalRates, History
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import Decision, PolicyConfig, PolicyState, Sample, decide
from autoscaler.providers import Provider, WorkerSpec
from control_plane.catalog.models import STOPPED, SUSPENDED, Deployment, Model
from tokenmill.bus import EventBus
from tokenmill.fleet import WorkerTable
from tokenmill.protocol import DEMAND, WORKERS, Demand, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.spool import OUTAGE_ERRORS
from tokenmill.tasks import Background, tail

log = logging.getLogger("tokenmill.autoscaler")

T = TypeVar("T")

# A request counts as waiting for this long after its gateway last said so (it says so
# about once a second while it waits).
DEMAND_TTL = 3.0

# The deployment's `autoscaling` settings (control_plane.catalog.schemas.Autoscaling) by policy field.
_SETTING = {
    "target_concurrency": "target_concurrency",
    "target_rate": "target_rate",
    "target_ttft": "target_ttft_seconds",
    "stable_window": "stable_window_seconds",
    "panic_window": "panic_window_seconds",
    "scale_down_cooldown": "scale_down_cooldown_seconds",
    "scale_to_zero_grace": "scale_to_zero_grace_seconds",
    "drain_time": "drain_time_seconds",
    "forecast": "forecast",
    "forecast_lead": "forecast_lead_seconds",
}
# Deployments whose settings the policy refused, and why: said once, not every tick.
_REFUSED: set[tuple[str, str]] = set()


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
    try:
        return PolicyConfig(min_replicas=dep.min_replicas, max_replicas=dep.max_replicas, **given)
    except ValueError as exc:
        # Written before the admin API checked them, or by hand: the deployment still scales,
        # on the defaults, and the operator is told.
        if (dep.id, str(exc)) not in _REFUSED:
            _REFUSED.add((dep.id, str(exc)))
            log.error("deployment %s: its autoscaling settings are ignored: %s", dep.id, exc)
        return PolicyConfig(min_replicas=dep.min_replicas, max_replicas=dep.max_replicas)


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


class _Table(WorkerTable):
    """The live workers, and what the reconciler measures from the same events."""

    def __init__(self, timeout: float, reconciler: Reconciler) -> None:
        super().__init__(timeout)
        self.arrivals = ArrivalRates()
        self._reconciler = reconciler

    def apply(self, ev: WorkerEvent) -> None:
        super().apply(ev)
        self.arrivals.observe(ev)
        if isinstance(ev, WorkerAnnounce):
            self._reconciler.announced(ev)


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
        metrics: AutoscalerMetrics | None = None,
    ) -> None:
        super().__init__()
        self.bus = bus
        self.sessionmaker = sessionmaker
        self.provider = provider
        self.lease = lease
        self.interval = interval
        self.metrics = metrics or AutoscalerMetrics.create()
        self.table = _Table(worker_timeout, self)
        self.samples: dict[str, History] = {}
        self.states: dict[str, PolicyState] = {}
        # Deployment -> monotonic times replicas were asked of the provider and have not
        # announced themselves yet, oldest first (the cold starts being timed).
        self.starting: dict[str, deque[float]] = {}
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

    def announced(self, ev: WorkerAnnounce) -> None:
        """A worker started: the oldest replica asked for its deployment has come up."""
        asked = self.starting.get(ev.deployment_id or "")
        if asked:
            took = time.monotonic() - asked.popleft()
            self.metrics.cold_start_seconds.labels(ev.deployment_id).observe(took)

    async def _provider(self, call: Awaitable[T]) -> T:
        """The provider's answer; a failure is counted, then raised as before."""
        try:
            return await call
        except Exception:
            self.metrics.provider_errors.labels(self.provider.name).inc()
            raise

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
        for dep_id in [d for d in self.samples if d not in desired]:
            self._forget(dep_id)
        if not await self.lease.hold():
            return
        for dep_id in set(await self._provider(self.provider.managed())) - desired.keys():
            log.info("deployment %s is stopped or gone: removing its workers", dep_id)
            await self._provider(self.provider.remove(dep_id))
            self._forget(dep_id)
        for worker in self.table.silent():
            wanted = desired.get(worker.deployment_id) if worker.deployment_id else None
            replace = wanted is not None and not wanted.held
            log.warning(
                "worker %s stopped sending heartbeats: %s",
                worker.worker_id,
                "replacing it" if replace else "counted as gone",
            )
            if replace:
                await self._provider(self.provider.replace(worker.deployment_id, worker.worker_id))
            self.table.workers.pop(worker.worker_id, None)
            # Said on its behalf (it never will, killed or cut off): every table drops it, and
            # its lifetime closes at its last heartbeat (what dedicated deployments bill).
            self.departures.append(
                WorkerDeparture(worker.worker_id, worker.deployment_id, ts=worker.sent, lost=True)
            )
        self.table.arrivals.retain(self.table.workers)
        await self._announce_departures()
        for want in desired.values():
            try:
                await self._reconcile(want, now)
            except ValueError as exc:
                # One deployment the provider cannot build (a setting it needs is missing, a
                # GPU type it has no size for) must not hold up every other deployment.
                log.error("cannot reconcile deployment %s: %s", want.spec.deployment_id, exc)

    def _forget(self, dep_id: str) -> None:
        """A deployment stopped or gone: nothing of it is kept, not even its metrics' series."""
        self.samples.pop(dep_id, None)
        self.states.pop(dep_id, None)
        self.decisions.pop(dep_id, None)
        self.starting.pop(dep_id, None)
        self.metrics.forget(dep_id)

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
        rate = self.table.arrivals.take(w.worker_id for w in workers)
        sample = Sample(
            ts=now,
            running=sum(w.running for w in workers),
            waiting=sum(w.waiting for w in workers) + len(held),
            kv_usage=sum(w.kv_usage for w in serving) / len(serving) if serving else 0.0,
            ttft_p95=max(ttfts) if ttfts else None,
            arrival_rate=rate,
        )
        self.samples.setdefault(dep_id, History()).add(sample, config)
        self.metrics.actual.labels(dep_id).set(len(serving))
        if rate is not None or not workers:  # no worker: nothing arrives (requests wait as demand)
            self.metrics.arrival_rate.labels(dep_id).set(rate or 0.0)

    async def _reconcile(self, want: Desired, now: float) -> None:
        dep_id = want.spec.deployment_id
        current = await self._provider(self.provider.replicas(dep_id))
        state = self.states.get(dep_id, PolicyState())
        if want.held:
            decision = Decision(0, False, "organisation suspended", state)
        else:
            history = self.samples.get(dep_id)
            decision = decide(want.config, history.samples() if history else (), current, state, now)
        self.states[dep_id] = decision.state
        self.decisions[dep_id] = decision
        self.metrics.desired.labels(dep_id).set(decision.desired)
        if decision.desired != current:
            log.info("%s: %d -> %d replicas (%s)", want.spec.name, current, decision.desired, decision.reason)
            direction = "up" if decision.desired > current else "down"
            self.metrics.decisions.labels(dep_id, direction).inc()
        # The idlest workers go first when scaling down: the least to drain.
        workers = [w for w in self.table.workers.values() if w.deployment_id == dep_id]
        victims = sorted(workers, key=lambda w: (w.running + w.waiting, w.kv_usage))
        await self._provider(self.provider.scale(want.spec, decision.desired, [w.worker_id for w in victims]))
        up = sum(not w.draining for w in workers)
        self._time_starts(dep_id, decision.desired - current, decision.desired - up)

    def _time_starts(self, dep_id: str, asked: int, missing: int) -> None:
        """Note `asked` new replicas (when positive), and keep at most `missing` being timed:
        fewer when a scale-down cancelled replicas still starting (the newest go first)."""
        starting = self.starting.setdefault(dep_id, deque())
        if asked > 0:
            self.metrics.cold_starts.labels(dep_id).inc(asked)
            starting.extend([time.monotonic()] * asked)
        while len(starting) > max(missing, 0):
            starting.pop()
