"""Continuous batching: token budget, chunked prefill, admission, preemption, priorities.

The engine is simulated: a fake "model" keeps a KV pool in which every slot records which
token prefix it was computed for, and checks before every step that each sequence's context
reads exactly its own prefix (so stale or foreign blocks would be caught); the fake
"sampler" appends token = position.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from workers.engine.block_manager import BlockManager
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import Sequence, Status

BS = 4
_ids = itertools.count()


def make_seq(
    tokens: list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float | None = None,
    salt: str | None = None,
    request_id: str | None = None,
) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=request_id or f"r{seq_id}",
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival=float(seq_id) if arrival is None else arrival,
        cache_salt=salt,
    )


def make_sched(num_blocks: int = 64, *, caching: bool = True, **cfg: Any) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**cfg), bm), bm


class FakeEngine:
    """The engine's step loop with a fake model that checks what every sequence would read."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.kv: dict[int, tuple] = {}  # slot -> (extra, token prefix whose last token is stored)
        self.outputs: list[SchedulerOutput] = []

    def _slot(self, seq: Sequence, p: int) -> int:
        return seq.block_table[p // BS] * BS + p % BS

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        sampled = {}
        for seq, n in out.batch:
            start = seq.num_computed_tokens
            assert n >= 1 and start + n <= seq.num_tokens
            assert len(seq.block_table) * BS >= start + n
            for p in range(start):  # the cached context this step attends to
                assert self.kv.get(self._slot(seq, p)) == (seq.hash_extra, tuple(seq.token_ids[: p + 1]))
            for p in range(start, start + n):
                self.kv[self._slot(seq, p)] = (seq.hash_extra, tuple(seq.token_ids[: p + 1]))
            if start + n == seq.num_tokens:  # prompt (or recompute) complete: sample
                sampled[seq.seq_id] = seq.num_tokens  # token = its position
        self.sched.update(out.batch, sampled)
        for seq, _ in out.batch:
            if seq.seq_id in sampled and seq.num_completion_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
        self.check()
        self.outputs.append(out)
        return out

    def run(self, limit: int = 10_000) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert len(self.outputs) < limit, "no progress"

    def check(self) -> None:
        refs = [0] * self.bm.num_blocks
        for seq in self.sched.running:
            assert seq.status is Status.RUNNING
            for b in seq.block_table:
                refs[b] += 1
        assert [blk.ref_count for blk in self.bm.blocks] == refs  # never negative, never leaked
        assert self.bm.num_free_blocks == sum(1 for r in refs if r == 0)
        assert self.bm.usage == pytest.approx(sum(1 for r in refs if r) / self.bm.num_blocks)


def shape(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in out.batch]


def test_chunked_prefill_behind_running_decodes() -> None:
    sched, _ = make_sched(max_num_batched_tokens=8)
    eng = FakeEngine(sched)
    a = make_seq(list(range(4)), max_tokens=10)
    sched.add(a)
    assert shape(eng.step()) == [(a.seq_id, 4)]
    b = make_seq(list(range(100, 120)), max_tokens=2)  # 20 tokens
    sched.add(b)
    steps = [shape(eng.step()) for _ in range(3)]
    assert steps == [
        [(a.seq_id, 1), (b.seq_id, 7)],
        [(a.seq_id, 1), (b.seq_id, 7)],
        [(a.seq_id, 1), (b.seq_id, 6)],
    ]
    assert b.num_completion_tokens == 1  # sampled only when its prompt completed
    assert a.num_completion_tokens == 4
    # Next step both decode, in admission order.
    assert shape(eng.step()) == [(a.seq_id, 1), (b.seq_id, 1)]


def test_long_prompt_alone_is_split_by_the_budget() -> None:
    sched, _ = make_sched(max_num_batched_tokens=8)
    eng = FakeEngine(sched)
    seq = make_seq(list(range(20)), max_tokens=1)
    sched.add(seq)
    eng.run()
    assert [shape(o) for o in eng.outputs] == [[(seq.seq_id, 8)], [(seq.seq_id, 8)], [(seq.seq_id, 4)]]
    assert seq.completion_token_ids == [20] and seq.finish_reason == "length"


def test_long_prefill_threshold_caps_chunks() -> None:
    sched, _ = make_sched(max_num_batched_tokens=100, long_prefill_threshold=6)
    eng = FakeEngine(sched)
    a, b = make_seq(list(range(10)), max_tokens=1), make_seq(list(range(50, 53)), max_tokens=1)
    sched.add(a)
    sched.add(b)
    assert shape(eng.step()) == [(a.seq_id, 6), (b.seq_id, 3)]
    assert shape(eng.step()) == [(a.seq_id, 4)]


def test_admission_stops_when_blocks_run_out() -> None:
    sched, bm = make_sched(num_blocks=5)
    seqs = [make_seq(list(range(i * 10, i * 10 + 8))) for i in range(4)]  # 2 blocks each
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.batch] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert bm.num_free_blocks == 1 and bm.usage == pytest.approx(4 / 5)
    assert seqs[2].status is Status.WAITING and seqs[2].block_table == []


def test_max_num_seqs_caps_running() -> None:
    sched, _ = make_sched(max_num_seqs=2)
    seqs = [make_seq([i, i + 1]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [s for s, _ in sched.schedule().batch] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_tiny_pool_everything_completes(caching: bool) -> None:
    sched, bm = make_sched(num_blocks=10, caching=caching, max_num_batched_tokens=16)
    eng = FakeEngine(sched)
    seqs = [make_seq(list(range(i * 7, i * 7 + 3 + i)), max_tokens=12 + i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    eng.run()
    assert sched.preemptions > 0
    assert sum(len(o.preempted) for o in eng.outputs) == sched.preemptions
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length"
        n = s.num_prompt_tokens
        assert s.num_completion_tokens == s.params.max_tokens
        assert s.completion_token_ids == list(range(n, n + s.params.max_tokens))
    assert any(s.num_preemptions for s in seqs)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_preemption_picks_newest_and_requeues_it_first() -> None:
    sched, _bm = make_sched(num_blocks=4)
    eng = FakeEngine(sched)
    a = make_seq(list(range(7)), max_tokens=8)  # 2 blocks, its 8th token fits in block 2
    b = make_seq(list(range(20, 27)), max_tokens=8)
    late = make_seq([1, 2, 3], max_tokens=1)
    sched.add(a)
    sched.add(b)
    eng.step()  # both prefilled: 4 blocks in use
    sched.add(late)
    out = eng.step()  # both decode position 7 inside their second block
    assert shape(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    out = eng.step()  # position 8 needs a third block for a: b (newest) is preempted
    assert out.preempted == [b]
    assert shape(out) == [(a.seq_id, 1)]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_completion_tokens == 2  # generated tokens kept, to be recomputed
    assert sched.num_waiting == 2 and sched.preemptions == 1
    # b waits ahead of the later arrival; its recompute covers all its tokens.
    eng.run()
    first_of = {}
    for i, o in enumerate(eng.outputs[3:]):
        for pos, (seq, _) in enumerate(o.batch):
            first_of.setdefault(seq.seq_id, (i, pos))
    assert first_of[b.seq_id] < first_of[late.seq_id]
    assert b.completion_token_ids == list(range(7, 15))


def test_victim_already_scheduled_this_step_is_taken_out_of_the_batch() -> None:
    # Lower priority loses first, even if it was admitted earlier and decodes earlier in the step.
    sched, _ = make_sched(num_blocks=4)
    eng = FakeEngine(sched)
    batch_job = make_seq(list(range(6)), max_tokens=8, priority=1, arrival=0.0)
    sched.add(batch_job)
    eng.step()
    chat = make_seq(list(range(30, 38)), max_tokens=8, priority=0, arrival=1.0)
    sched.add(chat)
    assert shape(eng.step()) == [(batch_job.seq_id, 1), (chat.seq_id, 8)]  # 4 blocks in use
    # batch_job's decode (position 7) fits and is scheduled first; chat's (position 8) needs a
    # third block, and the victim is batch_job: lowest priority.
    out = eng.step()
    assert out.preempted == [batch_job]
    assert shape(out) == [(chat.seq_id, 1)] and out.num_batched_tokens == 1
    assert batch_job.num_computed_tokens == 0 and batch_job.num_tokens == 8
    eng.run()
    assert batch_job.completion_token_ids == list(range(6, 14))
    assert chat.completion_token_ids == list(range(8, 16))


def test_sequence_that_cannot_fit_the_pool_is_finished_length() -> None:
    sched, bm = make_sched(num_blocks=2)
    eng = FakeEngine(sched)
    seq = make_seq(list(range(6)), max_tokens=10)
    sched.add(seq)
    eng.run()
    assert seq.finish_reason == "length"
    assert seq.num_completion_tokens == 3  # positions 6, 7, 8; position 8 would need a 3rd block
    assert any(seq in o.finished for o in eng.outputs)
    assert bm.num_free_blocks == 2
    with pytest.raises(ValueError):
        sched.add(make_seq(list(range(9))))


def test_priority_then_arrival_ordering() -> None:
    sched, _ = make_sched(max_num_seqs=1)
    eng = FakeEngine(sched)
    batch_old = make_seq([1, 2], max_tokens=1, priority=1, arrival=0.0)
    chat_late = make_seq([3, 4], max_tokens=1, priority=0, arrival=5.0)
    chat_early = make_seq([5, 6], max_tokens=1, priority=0, arrival=2.0)
    for s in (batch_old, chat_late, chat_early):
        sched.add(s)
    eng.run()
    order = [o.batch[0][0] for o in eng.outputs]
    assert order == [chat_early, chat_late, batch_old]


def _admitted(eng: FakeEngine) -> list[int]:
    """Prompt lengths in the order their sequences were first scheduled."""
    eng.run()
    seen: list[int] = []
    for out in eng.outputs:
        seen += [seq.num_prompt_tokens for seq, _ in out.batch if seq.num_prompt_tokens not in seen]
    return seen


def _burst(sched: Scheduler, arrivals_and_lengths: list[tuple[float, int]]) -> None:
    for i, (arrival, n) in enumerate(arrivals_and_lengths):
        sched.add(make_seq([100 * i + t for t in range(n)], max_tokens=1, arrival=arrival))


def test_a_burst_is_admitted_shortest_prompt_first() -> None:
    """Within the window of a burst's first arrival: shortest first. A later prompt, however
    short, does not overtake the burst: its own burst starts at its arrival."""
    sched, _ = make_sched(max_num_seqs=1)
    _burst(sched, [(10.0, 40), (10.2, 10), (10.5, 30), (10.9, 20), (11.0, 5), (11.3, 8)])
    assert _admitted(FakeEngine(sched)) == [10, 20, 30, 40, 5, 8]


@pytest.mark.parametrize("cfg", [{"policy": "fcfs"}, {"shortest_first_window": 0.0}])
def test_arrival_order_under_fcfs_or_without_the_window(cfg: dict[str, Any]) -> None:
    sched, _ = make_sched(max_num_seqs=1, **cfg)
    _burst(sched, [(10.0, 40), (10.2, 10), (10.5, 30), (10.9, 20)])
    assert _admitted(FakeEngine(sched)) == [40, 10, 30, 20]


def test_shortest_first_stays_within_a_key() -> None:
    """The window orders a tenant's own burst; between tenants, service still decides."""
    sched, _ = make_sched(max_num_seqs=1)
    for i, (key, n) in enumerate([("a", 30), ("a", 12), ("b", 20), ("b", 8)]):
        seq = make_seq([100 * i + t for t in range(n)], max_tokens=1, arrival=10.0 + i / 10)
        seq.fairness_key = key
        sched.add(seq)
    # Each key's shortest first (a's burst began earlier, so a goes first); then whichever
    # key is less served: b, having used 8 + 1 tokens to a's 12 + 1.
    assert _admitted(FakeEngine(sched)) == [12, 8, 20, 30]


def test_abort_frees_blocks_running_and_waiting() -> None:
    sched, bm = make_sched(num_blocks=4, max_num_seqs=1)
    eng = FakeEngine(sched)
    a = make_seq(list(range(9)), max_tokens=5)
    b = make_seq(list(range(3)), max_tokens=5)
    sched.add(a)
    sched.add(b)
    eng.step()
    assert bm.num_free_blocks == 1 and sched.num_waiting == 1
    assert sched.abort(b.request_id) == [b]
    assert b.status is Status.FINISHED and b.finish_reason == "abort" and sched.num_waiting == 0
    assert sched.abort(a.request_id) == [a]
    assert a.block_table == [] and bm.num_free_blocks == 4 and sched.num_running == 0
    assert not sched.has_unfinished()
    assert sched.abort("nope") == []
    assert sched.schedule().batch == []  # the aborted waiting entry is skipped


def test_abort_by_request_id_covers_every_sample() -> None:
    sched, bm = make_sched()
    samples = [make_seq([1, 2, 3], request_id="req") for _ in range(2)]
    for s in samples:
        sched.add(s)
    sched.schedule()
    assert sched.abort("req") == samples
    assert all(s.finish_reason == "abort" for s in samples)
    assert bm.usage == 0.0 and not sched.has_unfinished()


def test_update_ignores_sequences_aborted_during_the_step() -> None:
    sched, bm = make_sched()
    seq = make_seq(list(range(5)))
    sched.add(seq)
    out = sched.schedule()
    sched.abort_seq(seq)
    sched.update(out.batch, {seq.seq_id: 42})
    assert seq.num_computed_tokens == 0 and seq.token_ids == list(range(5))
    assert bm.num_cached_blocks == 0


def test_prefix_cache_hits_through_the_scheduler() -> None:
    sched, bm = make_sched()
    eng = FakeEngine(sched)
    prompt = list(range(100, 114))  # 3 full blocks + 2
    first = make_seq(prompt, salt="t1")
    sched.add(first)
    eng.run()
    second = make_seq(prompt, salt="t1")
    other_tenant = make_seq(prompt, salt="t2")
    sched.add(second)
    sched.add(other_tenant)
    assert shape(eng.step()) == [(second.seq_id, 2), (other_tenant.seq_id, 14)]
    assert (second.num_cached_tokens, other_tenant.num_cached_tokens) == (12, 0)
    eng.run()
    assert second.completion_token_ids == first.completion_token_ids
    assert (bm.queries, bm.hits) == (42, 12)


def test_whole_prompt_cached_still_computes_one_token() -> None:
    sched, _ = make_sched()
    eng = FakeEngine(sched)
    prompt = list(range(8))  # exactly 2 blocks
    sched.add(make_seq(prompt))
    eng.run()
    again = make_seq(prompt)
    sched.add(again)
    assert shape(eng.step()) == [(again.seq_id, 4)]
    assert again.num_cached_tokens == 4 and again.num_completion_tokens == 1


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_kv_consistent(seed: int) -> None:
    """Shared prefixes, tenants, priorities, late arrivals and aborts on a small pool: every
    step reads only its own prefix's KV (FakeEngine checks), and every sequence completes."""
    import random

    rng = random.Random(seed)
    caching = seed % 4 != 3
    sched, bm = make_sched(
        num_blocks=rng.randrange(8, 20),
        caching=caching,
        max_num_batched_tokens=rng.choice([4, 8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 16]),
    )
    eng = FakeEngine(sched)
    system = [rng.randrange(1000) for _ in range(rng.randrange(4, 14))]
    pending: list[Sequence] = []
    for _i in range(16):
        tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
        seq = make_seq(
            (system if rng.random() < 0.6 else []) + tail,
            max_tokens=rng.randrange(1, 10),
            priority=rng.randrange(2),
            salt=rng.choice([None, "t1"]),
        )
        pending.append(seq)
    aborted = set()
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(3)):
            if pending:
                sched.add(pending.pop(0))
        if rng.random() < 0.05 and sched.running:
            victim = rng.choice(sched.running)
            sched.abort_seq(victim)
            aborted.add(victim.seq_id)
        eng.step()
        assert len(eng.outputs) < 5000
    done = [s for o in eng.outputs for s, _ in o.batch]
    for s in {x.seq_id: x for x in done}.values():
        assert s.is_finished
        if s.seq_id not in aborted:
            assert s.completion_token_ids == list(range(s.num_prompt_tokens, s.num_tokens))
            assert s.num_completion_tokens == s.params.max_tokens
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.usage == 0.0
