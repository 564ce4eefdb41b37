"""The reconciler against a real database of deployments, the in-memory bus, and a
provider that records what it is asked (the Provider protocol's contract, nothing more);
the lease against a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import generate_latest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from autoscaler.leader import RedisLease, SoleLease
from autoscaler.policy import PolicyConfig, PolicyState, decide
from autoscaler.providers import WorkerSpec
from autoscaler.reconciler import Reconciler, desired_deployments, policy_config
from control_plane.catalog.models import SUSPENDED, Deployment, Model
from tokenmill.bus import MemoryBus
from tokenmill.db import Base, make_engine, make_sessionmaker
from tokenmill.protocol import (
    DEMAND,
    WORKERS,
    Demand,
    Heartbeat,
    WorkerAnnounce,
    WorkerDeparture,
    WorkerEvent,
)


@dataclass
class Recorder:
    """Keeps `replicas` per deployment exactly as asked, and logs every call."""

    name = "recorder"
    counts: dict[str, int] = field(default_factory=dict)
    calls: list[tuple] = field(default_factory=list)

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        if self.counts.get(spec.deployment_id, 0) != replicas:
            self.calls.append(("scale", spec.deployment_id, replicas, tuple(victims)))
        self.counts[spec.deployment_id] = replicas

    async def replicas(self, deployment_id: str) -> int:
        return self.counts.get(deployment_id, 0)

    async def replace(self, deployment_id: str, worker_id: str) -> None:
        self.calls.append(("replace", deployment_id, worker_id))

    async def remove(self, deployment_id: str) -> None:
        self.calls.append(("remove", deployment_id))
        self.counts.pop(deployment_id, None)

    async def managed(self) -> list[str]:
        return [d for d, n in self.counts.items() if n > 0]

    async def close(self) -> None:
        return None


@pytest.fixture
async def db(sqlite_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_engine(sqlite_url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield make_sessionmaker(engine)
    await engine.dispose()


async def _deployment(
    db: async_sessionmaker[AsyncSession], name: str, low: int, high: int, **autoscaling: float
) -> str:
    async with db() as session, session.begin():
        model = Model(name=f"m-{name}", source="bundled:smollm2", format="gguf")
        session.add(model)
        await session.flush()
        dep = Deployment(
            name=name,
            model_id=model.id,
            min_replicas=low,
            max_replicas=high,
            gpu_type="L4",
            config={"autoscaling": autoscaling} if autoscaling else None,
        )
        session.add(dep)
        await session.flush()
        return dep.id


def _reconciler(db: async_sessionmaker[AsyncSession], provider: Recorder, **kw: object) -> Reconciler:
    return Reconciler(
        MemoryBus(), db, provider, kw.pop("lease", SoleLease()), interval=0.1, worker_timeout=3.0, **kw
    )


def _beat(dep: str, worker: str, running: int = 0, waiting: int = 0, **kw: Any) -> Heartbeat:
    kw.setdefault("ts", time.time())
    return Heartbeat(worker, dep, f"http://{worker}", "m", running=running, waiting=waiting, **kw)


async def test_desired_state_comes_from_active_deployments(db: async_sessionmaker[AsyncSession]) -> None:
    dep = await _deployment(db, "chat", 1, 3, target_concurrency=4, stable_window_seconds=12)
    stopped = await _deployment(db, "old", 1, 1)
    async with db() as session, session.begin():
        (await session.get(Deployment, stopped)).status = "stopped"  # type: ignore[union-attr]
    desired = await desired_deployments(db)
    assert list(desired) == [dep]
    want = desired[dep]
    assert want.spec == WorkerSpec(
        dep, "chat", "bundled:smollm2", "generate", "L4", engine="builtin", engine_args={}, gpus=1, options={}
    )
    assert (want.config.min_replicas, want.config.max_replicas) == (1, 3)
    assert (want.config.target_concurrency, want.config.stable_window) == (4, 12)


async def test_a_vllm_deployments_spec_carries_its_engine_arguments_and_gpus(
    db: async_sessionmaker[AsyncSession],
) -> None:
    async with db() as session, session.begin():
        model = Model(name="llama-70b-awq", source="store:models/llama-70b-awq", format="hf")
        session.add(model)
        await session.flush()
        args = {"tensor_parallel_size": 4, "quantization": "awq", "enable_prefix_caching": True}
        big = Deployment(
            name="big",
            model_id=model.id,
            gpu_type="a100",
            engine="vllm",
            engine_args=args,
            gpus_per_replica=8,
            config={"resources": {"memory": "64Gi"}},
        )
        cpu = Deployment(name="cpu", model_id=model.id, engine="vllm", engine_args={"dtype": "float32"})
        session.add_all([big, cpu])
        await session.flush()
    desired = await desired_deployments(db)
    assert desired[big.id].spec == WorkerSpec(
        big.id,
        "big",
        "store:models/llama-70b-awq",
        gpu_type="a100",
        engine="vllm",
        engine_args=args,
        gpus=8,
        options={"memory": "64Gi"},
    )
    # Without a GPU type a deployment holds none.
    cpu_spec = desired[cpu.id].spec
    assert (cpu_spec.engine, cpu_spec.engine_args, cpu_spec.gpu_type, cpu_spec.gpus) == (
        "vllm",
        {"dtype": "float32"},
        None,
        0,
    )


async def test_starts_min_replicas_then_follows_load_within_max(db: async_sessionmaker[AsyncSession]) -> None:
    dep = await _deployment(db, "chat", 1, 3, target_concurrency=4, stable_window_seconds=2)
    provider = Recorder()
    rec = _reconciler(db, provider)
    await rec.tick()
    assert provider.calls == [("scale", dep, 1, ())]
    # 30 requests in flight on one worker: 30 / 4 wants 8, capped at max 3.
    rec.table.apply(_beat(dep, "w1", running=20, waiting=10))
    await rec.tick()
    assert provider.counts[dep] == 3
    assert rec.decisions[dep].desired == 3


@dataclass
class Refuses(Recorder):
    """Refuses to build one deployment's workers, as KubernetesProvider does a vllm one
    without TOKENMILL_VLLM_IMAGE."""

    refused: str = ""

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        if spec.deployment_id == self.refused:
            raise ValueError(f"deployment {spec.deployment_id}: a vllm deployment needs TOKENMILL_VLLM_IMAGE")
        await super().scale(spec, replicas, victims)


async def test_a_deployment_the_provider_refuses_does_not_hold_up_the_others(
    db: async_sessionmaker[AsyncSession], caplog: pytest.LogCaptureFixture
) -> None:
    bad = await _deployment(db, "bad", 1, 1)
    good = await _deployment(db, "good", 2, 2)
    provider = Refuses(refused=bad)
    rec = _reconciler(db, provider)
    await rec.tick()
    assert provider.counts == {good: 2}
    assert _value(rec, "tokenmill_autoscaler_provider_errors_total", provider="recorder") == 1
    assert f"cannot reconcile deployment {bad}" in caplog.text and "TOKENMILL_VLLM_IMAGE" in caplog.text


async def test_scales_down_after_idle_and_names_the_idlest_workers_first(
    db: async_sessionmaker[AsyncSession],
) -> None:
    dep = await _deployment(
        db, "chat", 1, 3, target_concurrency=4, stable_window_seconds=0.5, scale_down_cooldown_seconds=0.2
    )
    provider = Recorder(counts={dep: 3})
    rec = _reconciler(db, provider)
    for worker, running in (("w1", 2), ("w2", 0), ("w3", 1)):
        rec.table.apply(_beat(dep, worker, running=running))
    await rec.tick()
    assert provider.counts[dep] == 1  # 3 requests want one replica
    assert provider.calls[-1] == ("scale", dep, 1, ("w2", "w3", "w1"))


async def test_silent_workers_are_replaced(db: async_sessionmaker[AsyncSession]) -> None:
    dep = await _deployment(db, "chat", 1, 1)
    provider = Recorder(counts={dep: 1})
    rec = _reconciler(db, provider)
    last = _beat(dep, "w1")
    rec.table.apply(last)
    rec.table.workers["w1"].seen -= 10  # no heartbeat for 10 s (timeout 3 s)
    await rec.tick()
    assert ("replace", dep, "w1") in provider.calls
    assert "w1" not in rec.table.workers
    # its departure is announced for it: lost, at its last heartbeat (its lifetime's end)
    said = [
        msgspec.json.decode(raw, type=WorkerEvent) for _, raw in await rec.bus.read(WORKERS, "0", block=0)
    ]
    assert said == [WorkerDeparture("w1", dep, ts=last.ts, lost=True)]
    # A worker that said goodbye is simply gone, not replaced by `replace`.
    rec.table.apply(_beat(dep, "w2"))
    rec.table.apply(WorkerDeparture("w2", dep))
    await rec.tick()
    assert ("replace", dep, "w2") not in provider.calls


async def test_a_departure_the_bus_refused_is_announced_later(db: async_sessionmaker[AsyncSession]) -> None:
    class Down(MemoryBus):
        down = True

        async def publish(self, stream: str, event: object) -> str:
            if self.down:
                raise ConnectionError("Redis is down")
            return await super().publish(stream, event)  # type: ignore[arg-type]

    dep = await _deployment(db, "chat", 1, 1)
    provider = Recorder(counts={dep: 1})
    bus = Down()
    rec = Reconciler(bus, db, provider, SoleLease(), interval=0.1, worker_timeout=3.0)
    rec.table.apply(_beat(dep, "w1"))
    rec.table.workers["w1"].seen -= 10
    await rec.tick()  # the tick goes on without it
    assert ("replace", dep, "w1") in provider.calls and await bus.read(WORKERS, "0", block=0) == []
    bus.down = False
    await rec.tick()
    said = [msgspec.json.decode(raw, type=WorkerEvent) for _, raw in await bus.read(WORKERS, "0", block=0)]
    assert [(d.worker_id, d.lost) for d in said] == [("w1", True)]  # type: ignore[union-attr]
    assert provider.calls.count(("replace", dep, "w1")) == 1  # replaced once, not again


async def test_stopped_deployments_lose_their_workers(db: async_sessionmaker[AsyncSession]) -> None:
    dep = await _deployment(db, "chat", 1, 1)
    provider = Recorder()
    rec = _reconciler(db, provider)
    await rec.tick()
    assert _value(rec, "tokenmill_autoscaler_desired_replicas", deployment=dep) == 1
    async with db() as session, session.begin():
        (await session.get(Deployment, dep)).status = "stopped"  # type: ignore[union-attr]
    await rec.tick()
    assert provider.calls[-1] == ("remove", dep)
    assert await provider.managed() == []
    # Its series go too: a stopped deployment is not one whose replicas are missing.
    text = generate_latest(rec.metrics.registry).decode()
    assert "tokenmill_autoscaler_desired_replicas" in text and dep not in text


async def test_a_suspended_organisations_deployment_is_held_at_zero_and_comes_back(
    db: async_sessionmaker[AsyncSession],
) -> None:
    """Suspended (its organisation is): zero replicas whatever the load, its silent workers
    not replaced; active again, it starts from its minimum as any deployment does."""
    dep = await _deployment(db, "chat", 2, 3, target_concurrency=1, stable_window_seconds=5)
    provider = Recorder()
    rec = _reconciler(db, provider)
    await rec.tick()
    assert provider.counts[dep] == 2
    async with db() as session, session.begin():
        (await session.get(Deployment, dep)).status = SUSPENDED  # type: ignore[union-attr]
    assert (await desired_deployments(db))[dep].held
    rec.table.apply(_beat(dep, "w1", running=9, waiting=9))  # a burst would scale it up
    rec.table.apply(_beat(dep, "w2"))
    rec.table.workers["w2"].seen -= 10
    await rec.tick()
    assert provider.counts[dep] == 0 and rec.decisions[dep].desired == 0
    assert rec.decisions[dep].reason == "organisation suspended"
    assert ("replace", dep, "w2") not in provider.calls
    async with db() as session, session.begin():
        (await session.get(Deployment, dep)).status = "active"  # type: ignore[union-attr]
    rec.table.workers.clear()  # the burst's workers are gone, and its window with them
    rec.samples.clear()
    await rec.tick()
    assert provider.counts[dep] == 2 and not (await desired_deployments(db))[dep].held


async def test_a_waiting_request_wakes_a_deployment_at_zero(db: async_sessionmaker[AsyncSession]) -> None:
    dep = await _deployment(
        db,
        "serverless",
        0,
        2,
        scale_to_zero_grace_seconds=1,
        stable_window_seconds=1,
        scale_down_cooldown_seconds=0.5,
    )
    provider = Recorder()
    rec = _reconciler(db, provider)
    await rec.tick()
    assert provider.counts.get(dep, 0) == 0  # never used: nothing runs
    await rec.start()
    try:
        await asyncio.sleep(0.2)  # the tail is reading
        await rec.bus.publish(DEMAND, Demand(dep, "req-1", ts=time.time()))
        for _ in range(50):
            if provider.counts.get(dep) == 1:
                break
            await asyncio.sleep(0.05)
        assert provider.counts.get(dep) == 1
        # It serves; then, idle past the grace period, it goes back to zero.
        await rec.bus.publish(WORKERS, _beat(dep, "w1"))
        deadline = time.monotonic() + 8
        while provider.counts.get(dep) != 0 and time.monotonic() < deadline:
            await rec.bus.publish(WORKERS, _beat(dep, "w1"))
            await asyncio.sleep(0.2)
        assert provider.counts.get(dep) == 0
    finally:
        await rec.stop()


async def test_only_the_lease_holder_acts(db: async_sessionmaker[AsyncSession], redis_url: str) -> None:
    dep = await _deployment(db, "chat", 2, 2)
    redis = Redis.from_url(redis_url)
    await redis.delete("tm:test:leader")
    try:
        first, second = Recorder(), Recorder()
        a = _reconciler(db, first, lease=RedisLease(redis, "a", ttl=1.0, key="tm:test:leader"))
        b = _reconciler(db, second, lease=RedisLease(redis, "b", ttl=1.0, key="tm:test:leader"))
        for _ in range(3):
            await a.tick()
            await b.tick()
        assert first.counts == {dep: 2} and second.calls == []
        # The followers sample too, so a new leader starts with the history.
        assert len(b.samples[dep]) == 3
        await a.lease.release()
        await b.tick()
        assert second.counts == {dep: 2}
        # A leader that paused past its TTL finds the lease taken and stops acting.
        assert not await a.lease.hold()
        await asyncio.sleep(1.2)  # b's lease expires without renewal
        assert await a.lease.hold() and not await b.lease.hold()
    finally:
        await redis.delete("tm:test:leader")
        await redis.aclose()


def test_policy_settings_map_onto_the_policy() -> None:
    dep = Deployment(
        name="x",
        model_id="m",
        min_replicas=0,
        max_replicas=5,
        config={"autoscaling": {"target_ttft_seconds": 1.5, "scale_to_zero_grace_seconds": 30}},
    )
    config = policy_config(dep)
    assert (config.min_replicas, config.max_replicas) == (0, 5)
    assert (config.target_ttft, config.scale_to_zero_grace) == (1.5, 30)


def test_the_arrival_rate_settings_map_onto_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    settings = {"target_rate": 2.5, "drain_time_seconds": 20, "forecast": True, "forecast_lead_seconds": 90}
    config = policy_config(Deployment(id="d1", name="x", model_id="m", config={"autoscaling": settings}))
    assert (config.target_rate, config.drain_time, config.forecast) == (2.5, 20, True)
    assert config.forecast_lead == 90
    # A zero target written before the admin API refused one: the defaults, said once.
    bad = Deployment(
        id="d2", name="y", model_id="m", min_replicas=1, max_replicas=4,
        config={"autoscaling": {"target_concurrency": 0, "target_rate": 3}},
    )  # fmt: skip
    for _ in range(3):
        config = policy_config(bad)
        assert config == PolicyConfig(min_replicas=1, max_replicas=4)
    refused = [r for r in caplog.records if "autoscaling settings are ignored" in r.getMessage()]
    assert len(refused) == 1 and "target_concurrency must be above 0" in refused[0].getMessage()


def _value(rec: Reconciler, name: str, **labels: str) -> float | None:
    return rec.metrics.registry.get_sample_value(name, labels)


async def test_arrivals_scale_up_while_concurrency_is_within_target(
    db: async_sessionmaker[AsyncSession],
) -> None:
    """Requests arrive at 8/s on one replica that carries 3 at a time (target 8): concurrency
    wants 1 replica, the arrival rate (target 2/s) wants 4, before any queue builds."""
    dep = await _deployment(
        db,
        "chat",
        1,
        5,
        target_concurrency=8,
        target_rate=2,
        stable_window_seconds=10,
        panic_window_seconds=2,
    )
    provider = Recorder(counts={dep: 1})
    rec = _reconciler(db, provider)
    t0 = time.time()
    rec.table.apply(WorkerAnnounce("w1", dep, "http://w1", "m", ts=t0))
    rec.table.apply(_beat(dep, "w1", running=3, ts=t0 + 1, arrived=8, finished=5))
    await rec.tick()
    decision = rec.decisions[dep]
    assert provider.counts[dep] == decision.desired == 4
    assert "rate 8.00/s" in decision.reason
    samples = rec.samples[dep].samples()
    assert [s.arrival_rate for s in samples] == [8.0]
    assert all(s.running + s.waiting <= 8 for s in samples)  # within one replica's target...
    config = replace((await desired_deployments(db))[dep].config, target_rate=None)
    assert decide(config, samples, 1, PolicyState(), samples[-1].ts).desired == 1  # ...as concurrency alone

    assert _value(rec, "tokenmill_autoscaler_arrival_rate", deployment=dep) == 8.0
    assert _value(rec, "tokenmill_autoscaler_desired_replicas", deployment=dep) == 4
    assert _value(rec, "tokenmill_autoscaler_actual_replicas", deployment=dep) == 1
    assert _value(rec, "tokenmill_autoscaler_scaling_decisions_total", deployment=dep, direction="up") == 1
    assert _value(rec, "tokenmill_autoscaler_cold_starts_total", deployment=dep) == 3
    # Two of the three come up: their cold starts are timed, the third is still starting.
    for worker in ("w2", "w3"):
        rec.table.apply(WorkerAnnounce(worker, dep, f"http://{worker}", "m", ts=time.time()))
    assert _value(rec, "tokenmill_autoscaler_cold_start_seconds_count", deployment=dep) == 2
    assert len(rec.starting[dep]) == 1
    # A worker of another deployment, or one heard without an announcement, times nothing.
    rec.table.apply(WorkerAnnounce("x1", "other", "http://x1", "m", ts=time.time()))
    rec.table.apply(_beat(dep, "w9", ts=time.time()))
    assert _value(rec, "tokenmill_autoscaler_cold_start_seconds_count", deployment=dep) == 2


async def test_the_process_running_the_reconciler_serves_its_metrics(tmp_path: Path) -> None:
    """`tokenmill autoscaler` (and `serve`) serve the reconciler's own registry at /metrics."""
    from litestar.testing import AsyncTestClient

    from tokenmill.app import Parts, create_app
    from tokenmill.settings import Settings

    settings = Settings(
        home=tmp_path, database_url=f"sqlite:///{tmp_path}/tm.db", internal_token="metrics-token"
    )
    engine = make_engine(settings.db_url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    # The test client runs the app on its own loop in another thread: a connection pooled on
    # this loop, closed on that one, waits for this (blocked) loop for ever.
    await engine.dispose()
    app = create_app(settings, engine, Parts(autoscaler=True))
    rec = app.state.reconciler
    rec.metrics.provider_errors.labels("local").inc()
    async with AsyncTestClient(app) as client:
        r = await client.get("/metrics", headers={"Authorization": "Bearer metrics-token"})
    assert r.status_code == 200
    assert 'tokenmill_autoscaler_provider_errors_total{provider="local"} 1.0' in r.text
    assert "# TYPE tokenmill_autoscaler_cold_start_seconds histogram" in r.text
