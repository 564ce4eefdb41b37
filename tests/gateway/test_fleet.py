"""Routing: prefix overlap against load, from heartbeats and KV events on the bus."""

from __future__ import annotations

import asyncio
import time

from gateway.fleet import IMBALANCE, FleetView
from tokenmill.bus import MemoryBus
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.protocol import KV, WORKERS, Heartbeat, KvEvents, KvOp, WorkerDeparture

DEP = "dep_1"
PROMPT = list(range(100, 164))  # 4 blocks of 16


def _hashes(salt: str) -> list[str]:
    return [h.hex() for h in hash_blocks(PROMPT, 16, extra_keys(salt, None))]


def _fleet(*loads: int) -> FleetView:
    fleet = FleetView(MemoryBus(), timeout=30)
    for i, load in enumerate(loads):
        fleet.apply(Heartbeat(f"w{i}", DEP, f"http://w{i}", "m", running=load, ts=time.time()))
    return fleet


def test_prefers_the_longest_cached_prefix() -> None:
    fleet = _fleet(0, 0, 0)
    h = _hashes("org-a")
    fleet.apply_kv(KvEvents("w1", DEP, [KvOp("stored", h[:2])]))
    fleet.apply_kv(KvEvents("w2", DEP, [KvOp("stored", h[:3])]))
    assert fleet.pick(DEP, hashes=h).worker_id == "w2"
    # only an unbroken run from the first block counts
    fleet.apply_kv(KvEvents("w0", DEP, [KvOp("stored", h[1:])]))
    assert fleet.overlap("w0", h) == 0
    # evictions are applied in order
    fleet.apply_kv(KvEvents("w2", DEP, [KvOp("removed", h[:1]), KvOp("stored", h[:1])]))
    assert fleet.overlap("w2", h) == 3
    fleet.apply_kv(KvEvents("w2", DEP, [KvOp("stored", h[:1]), KvOp("removed", h[:1])]))
    assert fleet.overlap("w2", h) == 0
    assert fleet.pick(DEP, hashes=h).worker_id == "w1"


def test_other_tenants_prefixes_do_not_attract() -> None:
    fleet = _fleet(0, 0)
    fleet.apply_kv(KvEvents("w1", DEP, [KvOp("stored", _hashes("org-a"))]))
    # the same prompt of another organisation hashes differently: no affinity, least loaded wins
    assert fleet.overlap("w1", _hashes("org-b")) == 0
    fleet.apply(Heartbeat("w1", DEP, "http://w1", "m", running=1, ts=time.time()))
    assert fleet.pick(DEP, hashes=_hashes("org-b")).worker_id == "w0"


def test_load_imbalance_overrides_the_cache() -> None:
    fleet = _fleet(0, IMBALANCE)
    h = _hashes("org-a")
    fleet.apply_kv(KvEvents("w1", DEP, [KvOp("stored", h)]))
    assert fleet.pick(DEP, hashes=h).worker_id == "w1"  # busier, but within the guard
    fleet.apply(Heartbeat("w1", DEP, "http://w1", "m", running=IMBALANCE + 1, ts=time.time()))
    assert fleet.pick(DEP, hashes=h).worker_id == "w0"


def test_departure_forgets_the_cache() -> None:
    fleet = _fleet(0)
    fleet.apply_kv(KvEvents("w0", DEP, [KvOp("stored", _hashes("a"))]))
    fleet.apply(WorkerDeparture("w0", DEP))
    assert "w0" not in fleet.cached and fleet.pick(DEP) is None


async def test_tails_both_streams_from_the_bus() -> None:
    bus = MemoryBus()
    fleet = FleetView(bus, timeout=30)
    await fleet.start()
    try:
        await asyncio.sleep(0.05)  # let it take the streams' tails
        h = _hashes("org-a")
        await bus.publish(WORKERS, Heartbeat("w0", DEP, "http://w0", "m", ts=time.time()))
        await bus.publish(KV, KvEvents("w0", DEP, [KvOp("stored", h)]))
        for _ in range(100):
            if fleet.overlap("w0", h) == len(h):
                break
            await asyncio.sleep(0.01)
        assert fleet.overlap("w0", h) == len(h) and fleet.pick(DEP, hashes=h).worker_id == "w0"
    finally:
        await fleet.stop()
        await bus.close()
