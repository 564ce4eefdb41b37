"""The gateway's view of the worker fleet, built from heartbeats and KV events on the bus.

Every replica tails the same streams, so all replicas see the same workers and route alike.
A worker whose heartbeats stop for `worker_timeout_seconds` is no longer routed to. KV
events say which prompt blocks each worker holds in its prefix cache: with the default
`prefix` routing policy a request goes where the longest prefix of its prompt already is,
unless that worker is much busier than the least loaded one. A prompt whose prefix is cached
nowhere goes to the worker with the smallest cache footprint, so tenants spread over the
fleet's combined cache instead of crowding one worker's. Between sending a prompt to a worker
and that worker's KV events saying it stored the blocks (the whole prefill: seconds on a
CPU), the routing decision itself stands in for the events, so a tenant's concurrent
requests follow its first one instead of each computing the prefix on another worker.
`round_robin` and `least_loaded` ignore the caches (baselines, and fleets whose prompts
share nothing).

A request naming a LoRA adapter prefers, after prefix overlap, the workers whose heartbeats
list the adapter as loaded (or that were just sent a request for it): elsewhere the worker
first has to fetch and read the adapter. `least_loaded` uses the same preference between
equally loaded workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Collection, Sequence
from typing import Literal, NamedTuple, get_args

import msgspec

from gateway.metrics import GatewayMetrics
from tokenmill.bus import EventBus
from tokenmill.fleet import WorkerState, WorkerTable
from tokenmill.protocol import DEMAND, KV, Demand, KvEvents, WorkerDeparture, WorkerEvent
from tokenmill.tasks import Background, tail

log = logging.getLogger("tokenmill.gateway.fleet")

# Requests of extra load a worker may carry, beyond the least loaded, and still be chosen for
# its cached prefix: past this, waiting in its queue costs more than recomputing the prefix.
IMBALANCE = 4

# How long a routing decision counts as "this worker will hold these blocks" when no KV event
# has confirmed it yet: longer than a queued prefill normally waits, short enough that a
# request that failed before its prefill stops attracting others soon.
PENDING_SECONDS = 30.0

# How often a request waiting for a worker tells the autoscaler it is still waiting.
DEMAND_EVERY = 1.0

Routing = Literal["prefix", "round_robin", "least_loaded"]
ROUTING_POLICIES: tuple[str, ...] = get_args(Routing)


class Route(NamedTuple):
    """A routing decision: the worker, and how many leading blocks of the prompt it holds
    (or is about to hold: a prompt routed there moments ago) by the router's reckoning."""

    worker: WorkerState
    cached_blocks: int


class FleetView(WorkerTable, Background):
    name = "fleet-view"

    def __init__(
        self,
        bus: EventBus,
        *,
        timeout: float,
        routing: Routing = "prefix",
        metrics: GatewayMetrics | None = None,
    ) -> None:
        WorkerTable.__init__(self, timeout)
        Background.__init__(self)
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {routing!r}; one of {', '.join(ROUTING_POLICIES)}")
        self.bus = bus
        self.routing = routing
        self._turn: dict[str, int] = {}  # deployment id -> round-robin position
        self.cached: dict[str, set[str]] = {}  # worker id -> hex hashes of its cached blocks
        # worker id -> hex hash -> monotonic deadline: blocks of prompts routed there that its
        # KV events have not reported yet. Insertion-ordered with one TTL, so oldest first.
        self.pending: dict[str, dict[str, float]] = {}
        # worker id -> adapter id -> monotonic deadline: adapters of requests routed there that
        # its heartbeats do not list yet (it loads them on demand).
        self.pending_adapters: dict[str, dict[str, float]] = {}
        self._changed = asyncio.Event()
        metrics = metrics or GatewayMetrics.create()
        self._hit, self._no_hit, self._no_worker = (
            metrics.routing.labels(routing, outcome) for outcome in ("prefix_hit", "no_hit", "no_worker")
        )
        self._lag = metrics.bus_lag

    async def run(self) -> None:
        kv = msgspec.json.Decoder(KvEvents)
        await asyncio.gather(
            self.follow(self.bus, name=self.name),  # WORKERS, judged on evidence (tokenmill.fleet)
            tail(self.bus, KV, lambda raw: self.apply_kv(kv.decode(raw)), name=self.name),
        )

    def apply_kv(self, ev: KvEvents) -> None:
        if ev.ts:
            self._lag.set(time.time() - ev.ts)
        blocks = self.cached.setdefault(ev.worker_id, set())
        pending = self.pending.get(ev.worker_id, {})
        for op in ev.ops:
            if op.op == "stored":
                blocks.update(op.hashes)
            else:
                blocks.difference_update(op.hashes)
            # Either way the worker has now spoken for these blocks: its word replaces ours.
            for h in op.hashes:
                pending.pop(h, None)

    def apply(self, ev: WorkerEvent) -> None:
        WorkerTable.apply(self, ev)
        if ev.ts:
            self._lag.set(time.time() - ev.ts)
        if isinstance(ev, WorkerDeparture):
            self.cached.pop(ev.worker_id, None)
            self.pending.pop(ev.worker_id, None)
            self.pending_adapters.pop(ev.worker_id, None)
        self._changed.set()

    def pick(
        self,
        deployment_id: str,
        exclude: Collection[str] = (),
        hashes: Sequence[str] = (),
        adapter: str | None = None,
    ) -> WorkerState | None:
        """A live worker of the deployment for a prompt with block hashes `hashes` (using
        LoRA `adapter`), by the routing policy; None if there is none (outside `exclude`)."""
        route = self.route(deployment_id, exclude, hashes, adapter)
        return None if route is None else route.worker

    def route(
        self,
        deployment_id: str,
        exclude: Collection[str] = (),
        hashes: Sequence[str] = (),
        adapter: str | None = None,
    ) -> Route | None:
        """`pick`, with the chosen worker's share of the prompt's prefix."""
        candidates = [w for w in self.live(deployment_id) if w.worker_id not in exclude]
        if not candidates:
            return None
        now = time.monotonic()
        if self.routing == "prefix":
            chosen, cached = self._prefix(candidates, hashes, adapter, now)
        else:
            if self.routing == "round_robin":
                chosen = self._round_robin(deployment_id, candidates)
            else:
                chosen = min(
                    candidates, key=lambda w: (w.load, self._lacks(w, adapter, now), w.kv_usage, w.worker_id)
                )
            cached = self._expected_overlap(chosen.worker_id, hashes, now) if hashes else 0
        if adapter is not None and adapter not in chosen.adapters:
            pending = self.pending_adapters.setdefault(chosen.worker_id, {})
            for stale in [a for a, deadline in pending.items() if deadline <= now]:
                del pending[stale]
            pending[adapter] = now + PENDING_SECONDS
        return Route(chosen, cached)

    def _lacks(self, worker: WorkerState, adapter: str | None, now: float) -> bool:
        """Whether the worker would have to load `adapter` first (False without one)."""
        if adapter is None or adapter in worker.adapters:
            return False
        return self.pending_adapters.get(worker.worker_id, {}).get(adapter, 0.0) <= now

    def _round_robin(self, deployment_id: str, candidates: list[WorkerState]) -> WorkerState:
        # Ordered by id so the cycle is stable while heartbeats reorder nothing; a worker that
        # joins or leaves shifts the cycle by one, which is harmless.
        candidates.sort(key=lambda w: w.worker_id)
        turn = self._turn.get(deployment_id, 0)
        self._turn[deployment_id] = turn + 1
        return candidates[turn % len(candidates)]

    def _prefix(
        self, candidates: list[WorkerState], hashes: Sequence[str], adapter: str | None, now: float
    ) -> tuple[WorkerState, int]:
        """The worker holding (or about to hold) the longest prefix of `hashes` among those
        not much busier than the least loaded, then one holding `adapter`, the idler of equals;
        if none holds any of the prefix, one holding the adapter, then the one with the smallest
        cache footprint; and the blocks of that prefix. The choice is remembered as pending
        blocks."""
        least = min(w.load for w in candidates)
        eligible = [w for w in candidates if w.load <= least + IMBALANCE]
        scored = [(self._expected_overlap(w.worker_id, hashes, now), w) for w in eligible]
        best = max(score for score, _ in scored)
        if best > 0:
            chosen = min(
                (w for score, w in scored if score == best),
                key=lambda w: (self._lacks(w, adapter, now), w.load, w.kv_usage),
            )
        elif adapter is not None and any(not self._lacks(w, adapter, now) for w in eligible):
            # Where the adapter is loaded already, rather than fetch it onto another worker.
            holders = [w for w in eligible if not self._lacks(w, adapter, now)]
            chosen = min(holders, key=lambda w: (self._footprint(w.worker_id, now), w.load, w.kv_usage))
        else:
            # A miss computes the whole prompt wherever it goes; what the choice decides is
            # where this prefix will live. The worker holding the fewest blocks (ours pending
            # included) has the most room, or the least-used cache once all are full; with
            # least-loaded here every early miss would pile onto whichever worker is idle.
            chosen = min(eligible, key=lambda w: (self._footprint(w.worker_id, now), w.load, w.kv_usage))
        if hashes:
            self._expect(chosen.worker_id, hashes, now)
        return chosen, best

    def overlap(self, worker_id: str, hashes: Sequence[str]) -> int:
        """How many leading blocks of the prompt the worker has cached, by its KV events (a
        prefix cache can only use an unbroken run from the start)."""
        blocks = self.cached.get(worker_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def _expected_overlap(self, worker_id: str, hashes: Sequence[str], now: float) -> int:
        """`overlap`, counting blocks of prompts routed there that it has not reported yet."""
        blocks = self.cached.get(worker_id, set())
        pending = self.pending.get(worker_id, {})
        n = 0
        for h in hashes:
            if h not in blocks and pending.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def _footprint(self, worker_id: str, now: float) -> int:
        """Blocks the worker holds or is about to hold."""
        self._expire(worker_id, now)
        return len(self.cached.get(worker_id, ())) + len(self.pending.get(worker_id, ()))

    def _expect(self, worker_id: str, hashes: Sequence[str], now: float) -> None:
        """Remember that the worker will store the prompt's blocks it does not report yet."""
        self._expire(worker_id, now)
        blocks = self.cached.get(worker_id, set())
        pending = self.pending.setdefault(worker_id, {})
        deadline = now + PENDING_SECONDS
        for h in hashes:
            if h not in blocks:
                pending.pop(h, None)  # re-inserted at the end: the order stays by deadline
                pending[h] = deadline

    def _expire(self, worker_id: str, now: float) -> None:
        pending = self.pending.get(worker_id)
        while pending:
            h, deadline = next(iter(pending.items()))
            if deadline > now:
                break
            del pending[h]

    def forget(self, worker_id: str) -> None:
        """Drop a worker that failed a request; its next heartbeat brings it back."""
        self.workers.pop(worker_id, None)
        self.pending.pop(worker_id, None)
        self.pending_adapters.pop(worker_id, None)

    async def wait_for(
        self,
        deployment_id: str,
        wait: float,
        exclude: Collection[str] = (),
        hashes: Sequence[str] = (),
        request_id: str = "",
        adapter: str | None = None,
    ) -> Route | None:
        """A worker by `route`, waiting up to `wait` seconds for one to appear. While the
        deployment has no live worker at all, the wait is announced on the bus about once a
        second, so the autoscaler wakes a deployment scaled to zero (a cold start)."""
        deadline = time.monotonic() + wait
        announced = -math.inf
        while (route := self.route(deployment_id, exclude, hashes, adapter)) is None:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                self._no_worker.inc()
                return None
            if request_id and now - announced >= DEMAND_EVERY and not self.live(deployment_id):
                announced = now
                await self._announce(Demand(deployment_id, request_id, ts=time.time()))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, DEMAND_EVERY)):
                    await self._changed.wait()
        (self._hit if route.cached_blocks else self._no_hit).inc()
        return route

    async def _announce(self, demand: Demand) -> None:
        try:
            await self.bus.publish(DEMAND, demand)
        except Exception as exc:  # the wait goes on; a worker may still appear
            log.warning("could not announce demand for %s: %s", demand.deployment_id, exc)
