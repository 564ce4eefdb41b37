"""The live reconciler scales on the arrival rate (issue 20, acceptance 5): a burst of requests
scales a deployment up before the queue builds past one replica's target.

A production-style stack (tests/e2e/test_faults.py's: `tokenmill gateway` and `tokenmill
control-plane` on PostgreSQL and a private Redis), the deployment's autoscaling set through the
admin API, and a live reconciler (its own loop, the Redis bus) whose provider starts
`LocalProcessProvider` processes of tests/e2e/fake_worker.py: real processes that announce
themselves, heartbeat (running requests, arrived and finished counts) and stream tokens
`DELAY` seconds apart. The burst is `CLIENTS` openai SDK clients sending chat completions
back to back through the gateway: never more than CLIENTS requests in flight, below one
replica's `target_concurrency`, so concurrency alone keeps one replica; the arrival rate, well
above `target_rate`, asks for more. The test checks the decision, the samples it came from
(concurrency within target; the same samples without the rate term keep one replica), the new
workers serving, and the autoscaler's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from autoscaler.leader import SoleLease
from autoscaler.local import LocalProcessProvider
from autoscaler.policy import PolicyState, Sample, decide
from autoscaler.reconciler import Reconciler, desired_deployments
from tests.e2e import test_faults
from tests.e2e.test_faults import INTERNAL, MODEL, Stack
from tokenmill.bus import RedisBus
from tokenmill.protocol import WORKERS, Heartbeat, WorkerEvent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TARGET_CONCURRENCY = 4  # requests in flight one replica should carry
TARGET_RATE = 1.0  # requests/s one replica should take
CLIENTS = 3  # in flight at most: below TARGET_CONCURRENCY
DELAY = 0.1  # seconds between a fake worker's tokens: requests of 0.1-0.8 s
MAX_REPLICAS = 4

stack = test_faults.stack  # the fixture: gateway and control plane processes, PostgreSQL, Redis


@dataclass
class Burst:
    """`CLIENTS` clients sending chat completions back to back until stopped."""

    stack: Stack
    sent: int = 0
    failures: list[BaseException] = field(default_factory=list)
    inflight: int = 0
    most_inflight: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, i: int) -> None:
        async with self.stack.client() as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                self.sent += 1
                self.inflight += 1
                self.most_inflight = max(self.most_inflight, self.inflight)
                try:
                    reply = await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Client {i}, request {n}: hello."}],
                        max_tokens=8,
                    )
                    assert reply.usage is not None and reply.usage.completion_tokens > 0
                except Exception as exc:
                    self.failures.append(exc)
                finally:
                    self.inflight -= 1


@contextlib.asynccontextmanager
async def burst_of_requests(stack: Stack) -> AsyncIterator[Burst]:
    burst = Burst(stack)
    tasks = [asyncio.create_task(burst.client(i)) for i in range(CLIENTS)]
    try:
        yield burst
    finally:
        burst.stop.set()
        await asyncio.gather(*tasks)


async def _until(what: str, check: Callable[[], bool], seconds: float) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, f"timed out after {seconds:.0f}s waiting for {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_a_burst_scales_up_on_the_arrival_rate_before_the_queue_builds(stack: Stack) -> None:
    dep = stack.deployment_id
    scaling = {
        "target_concurrency": TARGET_CONCURRENCY,
        "target_rate": TARGET_RATE,
        "stable_window_seconds": 6,
        "panic_window_seconds": 2,
        "scale_down_cooldown_seconds": 60,
    }
    async with httpx.AsyncClient(base_url=f"{stack.control_plane}/admin/v1", timeout=30) as admin:
        await _until_answers(admin)
        r = await admin.patch(
            f"/deployments/{dep}",
            headers={"Authorization": f"Bearer {stack.key}"},
            json={"min_replicas": 1, "max_replicas": MAX_REPLICAS, "autoscaling": scaling},
        )
        assert r.status_code == 200, r.text
        assert r.json()["autoscaling"] == scaling

    provider = LocalProcessProvider(
        env={"REDIS_URL": stack.redis.url, "TOKENMILL_INTERNAL_TOKEN": INTERNAL, "PYTHONPATH": str(ROOT)},
        drain_timeout=10,
        program=(sys.executable, "-m", "tests.e2e.fake_worker", "--delay", str(DELAY)),
    )
    bus = RedisBus.from_url(stack.redis.url)
    rec = Reconciler(bus, stack.sessionmaker, provider, SoleLease(), interval=0.25, worker_timeout=3.0)
    await rec.start()
    try:
        # The reconciler starts the deployment's minimum; idle, it holds there.
        await stack.wait_for_workers(1, within=60)
        await _warm_up(stack)
        await asyncio.sleep(2)
        assert rec.decisions[dep].desired == 1 and await provider.replicas(dep) == 1

        def value(name: str, **labels: str) -> float:
            return rec.metrics.registry.get_sample_value(name, {"deployment": dep, **labels}) or 0.0

        async with burst_of_requests(stack) as burst:
            started = time.monotonic()
            took = await _until("a scale-up", lambda: rec.decisions[dep].desired > 1, 60)
            decision = rec.decisions[dep]
            samples = rec.samples[dep].samples()
            most_inflight = burst.most_inflight
            sent_then = burst.sent
            rate_then = value("tokenmill_autoscaler_arrival_rate")
            # The new replicas come up and take their share of the burst.
            await stack.wait_for_workers(2, within=60)
            await asyncio.sleep(1)
        elapsed = time.monotonic() - started
        print(
            f"scaled 1 -> {decision.desired} {took:.1f}s into the burst ({decision.reason}); "
            f"{sent_then} requests sent by then, at most {most_inflight} in flight; "
            f"{burst.sent} in {elapsed:.1f}s"
        )
        assert burst.failures == [], [repr(e) for e in burst.failures]

        # The decision came from the arrival rate...
        assert "rate" in decision.reason
        rates = [s.arrival_rate for s in samples if s.arrival_rate]
        assert rates and max(rates) > TARGET_RATE
        # ...taken from counters that count every request once: the workers' last reports add
        # up to what the clients sent.
        await asyncio.sleep(1)  # a few heartbeats since the last request ended
        assert sum((await _last_heartbeats(bus, dep)).values()) == burst.sent
        # ...while the queue was within one replica's target: never more than CLIENTS in
        # flight, and the samples (the replica's running + waiting) within target...
        assert most_inflight <= CLIENTS < TARGET_CONCURRENCY
        assert all(s.running + s.waiting <= TARGET_CONCURRENCY for s in samples)
        # ...so concurrency alone would have kept one replica on the same samples.
        config = (await desired_deployments(stack.sessionmaker))[dep].config
        assert config.target_rate == TARGET_RATE
        alone = decide(replace(config, target_rate=None), samples, 1, PolicyState(), _last(samples).ts)
        assert alone.desired == 1, alone.reason

        # The autoscaler's metrics tell the same story.
        assert rate_then > TARGET_RATE
        assert value("tokenmill_autoscaler_scaling_decisions_total", direction="up") >= 1
        assert value("tokenmill_autoscaler_desired_replicas") >= 2
        assert value("tokenmill_autoscaler_actual_replicas") >= 2
        assert value("tokenmill_autoscaler_cold_starts_total") >= 2  # the first worker, then the burst's
        assert value("tokenmill_autoscaler_cold_start_seconds_count") >= 2
    finally:
        await rec.stop()
        await provider.close()
        await bus.close()


async def _warm_up(stack: Stack) -> None:
    """A request the gateway refuses after tokenizing it (over the context length): its first
    request's costs (the key's lookup, the tokenizer's loading) are paid before the burst,
    without a request reaching the worker."""
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello " * 10_000}], max_tokens=8
            )


async def _last_heartbeats(bus: RedisBus, dep: str) -> dict[str, int]:
    """Each of the deployment's workers' latest `arrived` count, from the bus."""
    arrived: dict[str, int] = {}
    for _, raw in await bus.read(WORKERS, "0", block=0, count=100_000):
        ev = msgspec.json.decode(raw, type=WorkerEvent)
        if isinstance(ev, Heartbeat) and ev.deployment_id == dep:
            arrived[ev.worker_id] = ev.arrived
    return arrived


def _last(samples: list[Sample]) -> Sample:
    return max(samples, key=lambda s: s.ts)


async def _until_answers(admin: httpx.AsyncClient) -> None:
    """The control plane process takes a few seconds to start."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if (await admin.get("/models")).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the control plane never answered"
        await asyncio.sleep(0.3)
