"""What the reconciler measures of a deployment's load over time, from its workers' events.

`ArrivalRates`: each worker counts the requests that reached it since it started
(`Heartbeat.arrived`, cumulative, so a lost heartbeat loses nothing), and a worker's arrival
rate is the change in that count over the time between its reports, on the worker's own
clock (bus delays do not bend it). The count is read the way Prometheus reads a counter:

- a worker that starts announces itself first, so it counts from zero from its announcement
  (the requests of its first second count too);
- a worker first heard mid-life (this process started after it did) gives a baseline, not a
  rate: what it counted before is not an arrival now;
- a count that goes down is a worker restarted under the same id: all of its new count
  arrived since its previous report;
- a worker that leaves (its departure, or dropped as silent) stops counting at once.

`History`: a deployment's samples for the policy: every one within the stable window (what
its windows read), and, with the forecast on, the arrival rate before that averaged per
`season_bucket`, over twice the longest period the forecast looks for (a period shows once it
has recurred), so hours of history cost a few thousand small samples.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from autoscaler.policy import PolicyConfig, Sample
from tokenmill.protocol import Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent


@dataclass(slots=True)
class _Count:
    ts: float  # the worker's clock at its last report
    arrived: int  # its count then
    since: float  # the worker's clock when `take` last read it
    new: int = 0  # requests that arrived from `since` to `ts`
    rate: float | None = None  # requests/s over the last stretch `take` read


class ArrivalRates:
    """Arrival rates per worker, from the counters its heartbeats carry."""

    def __init__(self) -> None:
        self._counts: dict[str, _Count] = {}

    def observe(self, ev: WorkerEvent) -> None:
        if isinstance(ev, WorkerDeparture):
            self._counts.pop(ev.worker_id, None)
            return
        ts = ev.ts or time.time()
        if isinstance(ev, WorkerAnnounce):
            self._counts[ev.worker_id] = _Count(ts, 0, ts)
            return
        assert isinstance(ev, Heartbeat)
        count = self._counts.get(ev.worker_id)
        if count is None:
            self._counts[ev.worker_id] = _Count(ts, ev.arrived, ts)
            return
        if ts <= count.ts:
            return  # a duplicate or a report overtaken by a later one: nothing new in it
        grew = ev.arrived - count.arrived
        count.new += grew if grew >= 0 else ev.arrived
        count.ts, count.arrived = ts, ev.arrived

    def take(self, worker_ids: Iterable[str]) -> float | None:
        """The summed arrival rate of these workers since the previous `take` (a worker not
        heard from since then keeps its previous rate); None while none of them has one."""
        rates = []
        for worker_id in worker_ids:
            count = self._counts.get(worker_id)
            if count is None:
                continue
            if count.ts > count.since:
                count.rate = count.new / (count.ts - count.since)
                count.since, count.new = count.ts, 0
            if count.rate is not None:
                rates.append(count.rate)
        return sum(rates) if rates else None

    def retain(self, worker_ids: Collection[str]) -> None:
        """Forget the workers not in `worker_ids` (gone from the fleet without a departure)."""
        for worker_id in [w for w in self._counts if w not in worker_ids]:
            del self._counts[worker_id]


class History:
    """One deployment's samples (see the module's docstring)."""

    def __init__(self) -> None:
        self.recent: deque[Sample] = deque()  # within the stable window
        self.past: deque[Sample] = deque()  # bucket means of the arrival rate before it
        self._in_last = 0  # samples averaged into past[-1]

    def __len__(self) -> int:
        return len(self.past) + len(self.recent)

    def add(self, sample: Sample, config: PolicyConfig) -> None:
        self.recent.append(sample)
        while self.recent and self.recent[0].ts <= sample.ts - config.stable_window:
            old = self.recent.popleft()
            if config.forecast and old.arrival_rate is not None:
                self._fold(old, config.season_bucket)
        if not config.forecast:
            self.past.clear()
        while self.past and self.past[0].ts <= sample.ts - 2 * config.season_max:
            self.past.popleft()

    def _fold(self, sample: Sample, bucket: float) -> None:
        assert sample.arrival_rate is not None
        start = sample.ts - sample.ts % bucket
        last = self.past[-1] if self.past else None
        if last is not None and last.ts == start and last.arrival_rate is not None:
            n = self._in_last
            rate = (last.arrival_rate * n + sample.arrival_rate) / (n + 1)
            self.past[-1] = Sample(start, 0, 0, arrival_rate=rate)
            self._in_last = n + 1
        else:
            self.past.append(Sample(start, 0, 0, arrival_rate=sample.arrival_rate))
            self._in_last = 1

    def samples(self) -> list[Sample]:
        """What the policy is given: the past's bucket means, then the recent samples."""
        return [*self.past, *self.recent]
