"""Routing: prefix overlap against load, from heartbeats and KV events on the bus."""

from __future__ import annotations

import asyncio
import time
from typing import get_args

import pytest

from gateway.fleet import IMBALANCE, PENDING_SECONDS, ROUTING_POLICIES, FleetView, Routing
from tokenmill.bus import MemoryBus
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.protocol import KV, WORKERS, Heartbeat, KvEvents, KvOp, WorkerDeparture

DEP = "dep_1"
PROMPT = list(range(100, 164))  # 4 blocks of 16


def _hashes(salt: str) -> list[str]:
    return [h.hex() for h in hash_blocks(PROMPT, 16, extra_keys(salt, None))]


def _fleet(*loads: int, routing: Routing = "prefix") -> FleetView:
    fleet = FleetView(MemoryBus(), timeout=30, routing=routing)
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


def test_a_routed_prompt_attracts_its_followers_before_the_kv_events_arrive() -> None:
    fleet = _fleet(0, 0, 0)
    h = _hashes("org-a")
    first = fleet.pick(DEP, hashes=h).worker_id
    fleet.workers[first].inflight = 2  # still prefilling: no KV event yet, and busier than the rest
    assert fleet.overlap(first, h) == 0
    assert fleet.pick(DEP, hashes=h).worker_id == first
    # a longer prompt of the same organisation shares the leading blocks
    longer = [x.hex() for x in hash_blocks(PROMPT + list(range(300, 332)), 16, extra_keys("org-a", None))]
    assert fleet.pick(DEP, hashes=longer).worker_id == first
    # the worker's own events replace the guess: it evicted the first block meanwhile
    fleet.apply_kv(KvEvents(first, DEP, [KvOp("stored", h[1:]), KvOp("removed", h[:1])]))
    assert fleet.pick(DEP, hashes=h).worker_id != first


def test_pending_blocks_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    # A request that never reached its prefill (it failed, say) stops attracting others.
    fleet = _fleet(0, 0)
    h = _hashes("org-a")
    first = fleet.pick(DEP, hashes=h).worker_id
    fleet.workers[first].inflight = 1
    assert fleet.pick(DEP, hashes=h).worker_id == first  # busier, but about to hold the prefix
    later = time.monotonic() + PENDING_SECONDS + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    for w in ("w0", "w1"):
        fleet.apply(Heartbeat(w, DEP, f"http://{w}", "m", ts=time.time()))
    assert fleet.pick(DEP, hashes=h).worker_id != first
    assert fleet.pending[first] == {}


def test_uncached_prefixes_spread_over_the_caches() -> None:
    # All idle: each new organisation goes where the fewest blocks are held or on their way,
    # not all onto the first idle worker.
    fleet = _fleet(0, 0, 0)
    picks = [fleet.pick(DEP, hashes=_hashes(f"org-{i}")).worker_id for i in range(6)]
    assert sorted(picks) == ["w0", "w0", "w1", "w1", "w2", "w2"]
    # a worker that already holds many blocks gets the next newcomer last
    fleet = _fleet(0, 0)
    fleet.apply_kv(KvEvents("w0", DEP, [KvOp("stored", _hashes("org-a"))]))
    assert fleet.pick(DEP, hashes=_hashes("org-b")).worker_id == "w1"


def test_departure_forgets_the_cache() -> None:
    fleet = _fleet(0)
    fleet.apply_kv(KvEvents("w0", DEP, [KvOp("stored", _hashes("a"))]))
    fleet.apply(WorkerDeparture("w0", DEP))
    assert "w0" not in fleet.cached and fleet.pick(DEP) is None


def test_round_robin_cycles_over_healthy_workers_ignoring_caches() -> None:
    fleet = _fleet(0, 5, 0, routing="round_robin")
    h = _hashes("org-a")
    fleet.apply_kv(KvEvents("w1", DEP, [KvOp("stored", h)]))
    assert [fleet.pick(DEP, hashes=h).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2
    # a draining worker and one whose heartbeats stopped leave the cycle
    fleet.apply(Heartbeat("w1", DEP, "http://w1", "m", draining=True, ts=time.time()))
    fleet.workers["w2"].seen -= 60
    assert {fleet.pick(DEP, hashes=h).worker_id for _ in range(4)} == {"w0"}
    # a retry skips the workers already tried
    fleet.apply(Heartbeat("w1", DEP, "http://w1", "m", ts=time.time()))
    assert [fleet.pick(DEP, exclude={"w0"}).worker_id for _ in range(2)] == ["w1", "w1"]
    # each deployment has its own cycle
    fleet.apply(Heartbeat("x0", "dep_2", "http://x0", "m", ts=time.time()))
    assert fleet.pick("dep_2").worker_id == "x0"


def test_least_loaded_ignores_caches() -> None:
    fleet = _fleet(2, 1, 3, routing="least_loaded")
    h = _hashes("org-a")
    fleet.apply_kv(KvEvents("w0", DEP, [KvOp("stored", h)]))
    assert fleet.pick(DEP, hashes=h).worker_id == "w1"
    fleet.workers["w1"].inflight = 3  # our own in-flight requests count before the next beat
    assert fleet.pick(DEP, hashes=h).worker_id == "w0"


def test_routing_policies_match_the_setting() -> None:
    from tokenmill.settings import Settings

    assert get_args(Settings.model_fields["routing"].annotation) == ROUTING_POLICIES
    assert Settings().routing == "prefix" and FleetView(MemoryBus(), timeout=1).routing == "prefix"
    with pytest.raises(ValueError, match="unknown routing policy"):
        FleetView(MemoryBus(), timeout=1, routing="random")  # type: ignore[arg-type]


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


# --- LoRA adapters: prefer workers that have the adapter loaded ------------------------------


def _beat(fleet: FleetView, worker: str, load: int = 0, adapters: tuple[str, ...] = ()) -> None:
    fleet.apply(
        Heartbeat(worker, DEP, f"http://{worker}", "m", running=load, adapters=list(adapters), ts=time.time())
    )


def _adapter_hashes(salt: str, adapter: str) -> list[str]:
    return [h.hex() for h in hash_blocks(PROMPT, 16, extra_keys(salt, adapter))]


def test_prefers_workers_holding_the_adapter() -> None:
    fleet = _fleet(0, 0, 0)
    _beat(fleet, "w1", load=1, adapters=("ad-1",))
    h = _adapter_hashes("org-a", "ad-1")
    # Cached nowhere: the worker with the adapter loaded, though a little busier.
    assert fleet.pick(DEP, hashes=h, adapter="ad-1").worker_id == "w1"
    assert fleet.pick(DEP, hashes=_hashes("org-b")).worker_id != "w1"  # no adapter: no pull
    # A cached prefix still comes first (the prompt's blocks are what saves the most work).
    h2 = _adapter_hashes("org-d", "ad-1")
    fleet.apply_kv(KvEvents("w2", DEP, [KvOp("stored", h2[:2])]))
    assert fleet.pick(DEP, hashes=h2, adapter="ad-1").worker_id == "w2"
    # Much busier than the others: loading the adapter elsewhere beats queueing there.
    _beat(fleet, "w1", load=IMBALANCE + 1, adapters=("ad-1",))
    assert fleet.pick(DEP, hashes=_adapter_hashes("org-c", "ad-1"), adapter="ad-1").worker_id != "w1"


def test_a_routed_adapter_attracts_its_followers_before_the_heartbeat() -> None:
    fleet = _fleet(0, 0)
    first = fleet.pick(DEP, adapter="ad-2")
    assert first is not None and fleet.pending_adapters[first.worker_id]
    other = "w1" if first.worker_id == "w0" else "w0"
    _beat(fleet, first.worker_id, load=1)  # busier now, and its heartbeat does not list it yet
    assert fleet.pick(DEP, adapter="ad-2").worker_id == first.worker_id
    assert fleet.pick(DEP).worker_id == other
    fleet.forget(first.worker_id)
    assert first.worker_id not in fleet.pending_adapters


def test_least_loaded_breaks_ties_by_adapter() -> None:
    fleet = _fleet(0, 0, routing="least_loaded")
    _beat(fleet, "w1", adapters=("ad-3",))
    assert fleet.pick(DEP, adapter="ad-3").worker_id == "w1"
    _beat(fleet, "w1", load=1, adapters=("ad-3",))
    assert fleet.pick(DEP, adapter="ad-3").worker_id == "w0"  # load first
