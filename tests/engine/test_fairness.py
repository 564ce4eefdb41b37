"""Fair scheduling across tenants: virtual token counters, lift on return, priority above
fairness, work conservation, no starvation under a flood. The engine is test_scheduler's
FakeEngine (a fake model that checks every sequence's KV reads; token = position)."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.engine.test_scheduler import BS, FakeEngine
from workers.engine.block_manager import BlockManager
from workers.engine.fairness import ServiceCounters
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence, Status

_ids = itertools.count(10_000)


def seq_of(key: str | None, prompt: int = 4, max_tokens: int = 4, *, priority: int = 0) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=[seq_id % 97 + i for i in range(prompt)],  # distinct prompts: no cache hits
        num_prompt_tokens=prompt,
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival=float(seq_id),
        fairness_key=key,
    )


def sched_of(num_blocks: int = 256, policy: str = "fair", **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(policy=policy, **cfg), BlockManager(num_blocks, BS))


def admitted(eng: FakeEngine) -> list[Sequence]:
    """Sequences in the order they were first scheduled."""
    seen: dict[int, Sequence] = {}
    for out in eng.outputs:
        for seq, _ in out.batch:
            seen.setdefault(seq.seq_id, seq)
    return list(seen.values())


# --- the counters ------------------------------------------------------------------------


def test_counters_charge_weighted_computed_prompt_and_output_tokens() -> None:
    sched = Scheduler(
        SchedulerConfig(prompt_weight=1.0, output_weight=3.0, max_num_batched_tokens=5),
        BlockManager(64, BS),
    )
    eng = FakeEngine(sched)
    a = seq_of("a", prompt=12, max_tokens=4)  # prefilled in chunks of 5, 5, 2
    sched.add(a)
    eng.run()
    assert sched.service["a"] == 12 + 3 * 4
    # The same prompt again: its two full cached blocks are not computed, so not charged.
    again = Sequence(
        seq_id=next(_ids),
        request_id="again",
        token_ids=list(a.prompt_token_ids),
        num_prompt_tokens=12,
        params=SamplingParams(max_tokens=1),
        fairness_key="b",
    )
    sched.add(again)
    eng.run()
    assert again.num_cached_tokens == 8
    assert sched.service["b"] == (12 - 8) + 3 * 1


def test_lift_on_return_no_banking_of_idle_credit() -> None:
    s = ServiceCounters()
    s.add("a")
    s.wait("a")
    s.charge("a", prompt_tokens=100)
    s.add("b")
    s.wait("b")  # joins while a waits: lifted to a's counter, not left at 0
    assert s["b"] == 100
    s.charge("b", prompt_tokens=10)
    s.unwait("a")
    s.charge("a", output_tokens=200)  # a keeps running after leaving the waiting set
    s.unwait("b")  # the waiting set empties: b left last, its counter is the floor
    assert s.floor == 110
    s.finish("b")
    # c was never seen, b comes back after being idle: both start at the floor, not below it.
    for key in ("c", "b"):
        s.add(key)
        s.wait(key)
        assert s[key] == 110
    s.add("a")
    s.wait("a")
    assert s["a"] == 500  # a served more than the floor: it keeps its counter
    assert s.waiting == {"a": 1, "b": 1, "c": 1}


def test_forgotten_keys_are_the_caught_up_idle_ones() -> None:
    s = ServiceCounters()
    s.add("heavy")
    s.wait("heavy")
    s.charge("heavy", prompt_tokens=1_000)
    for i in range(100):
        s.add(f"k{i}")
        s.wait(f"k{i}")
        s.unwait(f"k{i}")
        s.finish(f"k{i}")
    # "heavy" still waits; the idle keys at or below the floor (100 of them) were swept.
    assert len(s.counters) <= 2 * len(s.unfinished) + 64
    assert s["heavy"] == 1_000


# --- admission ---------------------------------------------------------------------------


def test_least_served_key_goes_first_then_alternates() -> None:
    sched = sched_of(max_num_seqs=1)
    eng = FakeEngine(sched)
    flood = [seq_of("a") for _ in range(4)]
    for s in flood:
        sched.add(s)
    eng.step()  # a's first request runs alone
    late = [seq_of("b") for _ in range(2)]
    for s in late:
        sched.add(s)
    eng.run()
    # b arrived after a's whole flood yet alternates with it from the next free slot.
    assert [s.fairness_key for s in admitted(eng)] == ["a", "b", "a", "b", "a", "a"]

    fcfs = sched_of(max_num_seqs=1, policy="fcfs")
    eng = FakeEngine(fcfs)
    for s in [seq_of("a") for _ in range(4)]:
        fcfs.add(s)
    eng.step()
    for s in [seq_of("b") for _ in range(2)]:
        fcfs.add(s)
    eng.run()
    assert [s.fairness_key for s in admitted(eng)] == ["a", "a", "a", "a", "b", "b"]


def test_priority_class_comes_before_fairness() -> None:
    sched = sched_of(max_num_seqs=1)
    eng = FakeEngine(sched)
    sched.add(seq_of("busy", prompt=40, max_tokens=1))
    eng.run()  # "busy" is far ahead in service
    batch_job = seq_of("idle", priority=1)
    chat = seq_of("busy", priority=0)
    sched.add(batch_job)
    sched.add(chat)
    assert sched.service["idle"] < sched.service["busy"]
    eng.run()
    assert admitted(eng)[-2:] == [chat, batch_job]


def test_work_conserving_when_the_least_served_key_cannot_start() -> None:
    # "b" is least served but its only waiting request is gated (its adapter has no slot):
    # "a"'s requests fill the batch instead of the engine idling.
    gate_open = False
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8),
        BlockManager(256, BS),
        admit=lambda s: s.fairness_key != "b" or gate_open,
    )
    eng = FakeEngine(sched)
    for _ in range(3):
        sched.add(seq_of("a", prompt=8))
    eng.run()
    b = seq_of("b")
    sched.add(b)
    flood = [seq_of("a") for _ in range(5)]
    for s in flood:
        sched.add(s)
    assert sched.service["b"] < sched.service["a"]
    out = eng.step()
    assert [s for s, _ in out.batch] == flood and b.status is Status.WAITING
    gate_open = True
    out = eng.step()
    assert out.batch[-1] == (b, 4)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [20, 80])
def test_never_idle_while_something_waits(seed: int, num_blocks: int) -> None:
    """Random tenants, sizes, priorities and arrival steps: a step is empty only when nothing
    waits, every request completes, and (when the pool is large enough that preemption does not
    reshape the work) fair needs about as many steps as fcfs for the same arrivals."""
    rng = random.Random(seed)
    spec = [
        (rng.randrange(60), rng.choice("abc"), rng.randrange(1, 20), rng.randrange(1, 12), rng.randrange(2))
        for _ in range(40)
    ]
    spec.sort()
    steps = {}
    for policy in ("fair", "fcfs"):
        sched = sched_of(num_blocks=num_blocks, policy=policy, max_num_seqs=6, max_num_batched_tokens=16)
        eng = FakeEngine(sched)
        pending = list(spec)
        while pending or sched.has_unfinished():
            while pending and pending[0][0] <= len(eng.outputs):
                _, key, prompt, max_tokens, priority = pending.pop(0)
                sched.add(seq_of(key, prompt, max_tokens, priority=priority))
            waiting = sched.num_waiting
            out = eng.step()
            assert out.batch or not waiting, "idle while requests wait"
            assert len(eng.outputs) < 2000
        steps[policy] = len(eng.outputs)
        assert all(s.is_finished for s in admitted(eng)) and len(admitted(eng)) == 40
        assert not sched.service.waiting and not sched.service.unfinished
    if num_blocks == 80:
        assert steps["fair"] <= steps["fcfs"] * 1.05 + 1


def test_no_starvation_under_a_flood() -> None:
    """Tenant a dumps 40 requests at once; b sends one every 6 steps. Under fair scheduling each
    of b's requests starts as soon as a slot frees (at most one generation of a's, 8 steps); under
    fcfs it waits behind a's whole backlog."""
    waits = {}
    for policy in ("fair", "fcfs"):
        sched = sched_of(policy=policy, max_num_seqs=4)
        eng = FakeEngine(sched)
        for _ in range(40):
            sched.add(seq_of("a", max_tokens=8))
        arrived: dict[int, int] = {}
        started: dict[int, int] = {}
        step = 0
        while sched.has_unfinished():
            if step % 6 == 0 and step < 60:
                b = seq_of("b", max_tokens=8)
                sched.add(b)
                arrived[b.seq_id] = step
            for seq, _ in eng.step().batch:
                started.setdefault(seq.seq_id, step)
            step += 1
        waits[policy] = max(started[i] - arrived[i] for i in arrived)
    assert waits["fair"] <= 8
    assert waits["fcfs"] > 40


def test_two_floods_share_the_engine_evenly() -> None:
    sched = sched_of(max_num_seqs=4)
    eng = FakeEngine(sched)
    for _ in range(30):
        sched.add(seq_of("a", prompt=4, max_tokens=4))
        sched.add(seq_of("b", prompt=8, max_tokens=8))  # b's requests cost 2x a's
    one_request = {"a": 4 + 2 * 4, "b": 8 + 2 * 8}
    while sched.service.waiting.keys() == {"a", "b"}:  # while both are backlogged
        eng.step()
        gap = abs(sched.service["a"] - sched.service["b"])
        assert gap <= 4 * max(one_request.values())  # within a batch of requests
    # Service, not request count, is shared: a got about 2x as many requests in.
    first = admitted(eng)
    n_a = sum(s.fairness_key == "a" for s in first)
    n_b = len(first) - n_a
    assert 1.5 <= n_a / n_b <= 2.5


def test_preemption_takes_the_most_served_key_first() -> None:
    sched = sched_of(num_blocks=6)
    eng = FakeEngine(sched)
    heavy_old = seq_of("heavy", prompt=7, max_tokens=8)
    sched.add(heavy_old)
    eng.step()
    light = seq_of("light", prompt=7, max_tokens=8)  # newer than heavy_old, but less served
    heavy_new = seq_of("heavy", prompt=3, max_tokens=8)
    sched.add(light)
    sched.add(heavy_new)
    eng.step()
    preempted = []
    while sched.has_unfinished():
        preempted += eng.step().preempted
    assert preempted and all(s.fairness_key == "heavy" for s in preempted)
    assert light.num_preemptions == 0
    assert all(
        s.completion_token_ids == list(range(s.num_prompt_tokens, s.num_tokens))
        for s in (heavy_old, light, heavy_new)
    )


def test_aborted_waiting_requests_leave_their_key() -> None:
    sched = sched_of(max_num_seqs=1)
    eng = FakeEngine(sched)
    a = seq_of("a")
    sched.add(a)
    eng.step()
    gone = seq_of("b")
    sched.add(gone)
    sched.abort(gone.request_id)
    assert "b" not in sched.service.waiting and "b" not in sched.service.unfinished
    after = seq_of("c")
    sched.add(after)
    eng.run()
    assert admitted(eng) == [a, after]
    assert sched.num_waiting == 0 and not sched._queues


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(policy="lottery")


def test_light_tenant_prompt_goes_ahead_of_a_heavy_tenants_chunk() -> None:
    """Under fair, a less-served key's prompt is scheduled before another key's remaining prefill
    chunk, so it is not split across steps; under fcfs the running chunk goes first."""
    for policy, expected in (("fair", [("b", 8), ("a", 8)]), ("fcfs", [("a", 16)])):
        sched = sched_of(policy=policy, max_num_batched_tokens=16)
        eng = FakeEngine(sched)
        heavy = seq_of("a", prompt=40, max_tokens=2)
        sched.add(heavy)
        eng.step()  # 16 of its 40 prompt tokens
        light = seq_of("b", prompt=8, max_tokens=2)
        sched.add(light)
        out = eng.step()
        assert [(s.fairness_key, n) for s, n in out.batch] == expected
        eng.run()
        assert heavy.completion_token_ids == [40, 41] and light.completion_token_ids == [8, 9]


@pytest.mark.parametrize(("slack", "order"), [(0.0, ["b", "a", "b"]), (None, ["b", "b", "a"])])
def test_within_the_slack_the_key_with_fewer_running_goes_first(
    slack: float | None, order: list[str]
) -> None:
    """b sends two requests while a's flood waits. Strict VTC (no slack) alternates as soon as
    b's counter passes a's by one prompt; with the default slack (one step's budget) b's
    second request, a few tokens "ahead" of a, still goes first: b has far fewer running."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, fairness_slack=slack),
        BlockManager(256, BS),
    )
    eng = FakeEngine(sched)
    for _ in range(8):
        sched.add(seq_of("a", prompt=4, max_tokens=4))
    eng.step()  # four of a's run
    for _ in range(2):
        sched.add(seq_of("b", prompt=4, max_tokens=4))
    assert sched.service["b"] == sched.service["a"]  # lifted on arrival
    out = eng.step()
    assert [s.fairness_key for s, n in out.batch if n > 1] == order


@pytest.mark.parametrize(("policy", "first"), [("fair", "b"), ("fcfs", "a")])
def test_a_light_tenants_chunk_goes_before_a_heavy_tenants_earlier_one(policy: str, first: str) -> None:
    sched = sched_of(policy=policy, max_num_batched_tokens=16, long_prefill_threshold=8)
    eng = FakeEngine(sched)
    heavy = seq_of("a", prompt=40, max_tokens=2)
    sched.add(heavy)
    eng.step()
    light = seq_of("b", prompt=40, max_tokens=2)
    sched.add(light)
    eng.step()
    assert heavy.is_prefill and light.is_prefill and light.num_computed_tokens  # both part done
    # a has had far more service (under fcfs there is one key for all: no difference).
    sched.service.charge("a" if policy == "fair" else None, prompt_tokens=1000)
    out = eng.step()
    assert [s.fairness_key for s, _ in out.batch] == [first, "b" if first == "a" else "a"]
