"""Paged KV block allocator with prefix caching: reference counts, LRU eviction, events."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.hashing import hash_blocks
from workers.engine.block_manager import BlockManager, BlockRemoved, BlockStored, KVEvent
from workers.engine.sampling import SamplingParams
from workers.engine.sequence import Sequence

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], *, salt: str | None = None, adapter: str | None = None) -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        request_id=f"r{next(_ids)}",
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        cache_salt=salt,
        adapter_id=adapter,
    )


def make_bm(num_blocks: int = 16, **kw: object) -> tuple[BlockManager, list[KVEvent]]:
    events: list[KVEvent] = []
    return BlockManager(num_blocks, BS, on_event=events.append, **kw), events


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' the whole prompt in one step, as the scheduler would."""
    n = seq.num_tokens - bm.lookup(seq)
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq, seq.num_computed_tokens)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == refs
    assert all(r >= 0 for r in refs)
    in_use = sum(1 for r in refs if r)
    assert bm.num_free_blocks == bm.num_blocks - in_use
    assert bm.usage == pytest.approx(in_use / bm.num_blocks)
    for h, b in bm._cached.items():
        assert bm.blocks[b].hash == h
    assert sum(1 for blk in bm.blocks if blk.hash is not None) == len(bm._cached)


def test_allocate_covers_tokens_and_usage() -> None:
    bm, _ = make_bm(8)
    seq = make_seq(list(range(10)))
    assert bm.usage == 0.0
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    # Growing by one token inside the last block needs nothing; past it, one more block.
    seq.num_computed_tokens = 10
    seq.token_ids.append(99)
    assert bm.allocate(seq, 1) and len(seq.block_table) == 3
    seq.num_computed_tokens = 11
    seq.token_ids.append(100)
    assert bm.allocate(seq, 1) and len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    seq.token_ids.append(101)
    assert bm.allocate(seq, 1) and len(seq.block_table) == 4
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.free(seq)  # a second free is harmless: the table is empty
    check_invariants(bm, [])


def test_allocate_fails_without_changes_when_short() -> None:
    bm, _ = make_bm(3)
    a = make_seq(list(range(8)))
    assert bm.allocate(a, 8)
    b = make_seq(list(range(100, 108)))
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(b, 4) and bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_prefix_hit_for_same_prompt_and_counters() -> None:
    bm, _ = make_bm(16)
    prompt = list(range(13))  # 3 full blocks + 1 token
    a = make_seq(prompt)
    run_prefill(bm, a)
    assert a.num_cached_tokens == 0
    assert (bm.queries, bm.hits) == (13, 0)
    b = make_seq(prompt)
    assert bm.lookup(b) == 12
    run_prefill(bm, b)
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 13
    assert b.block_table[:3] == a.block_table[:3]  # shared
    assert b.block_table[3] != a.block_table[3]  # the partial block is private
    assert [bm.blocks[x].ref_count for x in a.block_table[:3]] == [2, 2, 2]
    assert (bm.queries, bm.hits) == (26, 12)
    check_invariants(bm, [a, b])


def test_no_hits_across_salt_or_adapter() -> None:
    bm, _ = make_bm(32)
    prompt = list(range(13))
    run_prefill(bm, make_seq(prompt, salt="tenant-a"))
    for other in (
        make_seq(prompt, salt="tenant-b"),
        make_seq(prompt),
        make_seq(prompt, salt="tenant-a", adapter="x"),
    ):
        assert bm.lookup(other) == 0
        run_prefill(bm, other)
        assert other.num_cached_tokens == 0
    same = make_seq(prompt, salt="tenant-a")
    assert bm.lookup(same) == 12


def test_hits_capped_at_prompt_len_minus_one() -> None:
    bm, _ = make_bm(16)
    prompt = list(range(8))  # exactly 2 full blocks
    a = make_seq(prompt)
    run_prefill(bm, a)
    b = make_seq(prompt)
    assert bm.lookup(b) == 4  # the last full block is dropped so one token gets computed
    assert bm.allocate(b, 4)
    assert b.num_computed_tokens == 4 and len(b.block_table) == 2
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    one = make_seq([0])
    assert bm.lookup(one) == 0


def test_generated_tokens_are_committed_and_events_chain() -> None:
    bm, events = make_bm(16)
    seq = make_seq(list(range(6)))
    run_prefill(bm, seq)  # one full block
    assert events == [BlockStored([seq.block_hashes[0]], None)]
    events.clear()
    for tok in (50, 51, 52):  # decode: the second block fills with generated tokens
        seq.token_ids.append(tok)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq, seq.num_computed_tokens)
    hashes = hash_blocks(seq.token_ids, BS, seq.hash_extra)
    assert seq.num_computed_tokens == 9 and len(hashes) == 2
    assert events == [BlockStored([hashes[1]], hashes[0])]
    # A later prompt that starts with prompt + generated tokens hits both blocks.
    other = make_seq([*seq.token_ids[:8], 7, 7])
    assert bm.lookup(other) == 8


def test_chunked_commit_emits_one_chain_per_step() -> None:
    bm, events = make_bm(16)
    seq = make_seq(list(range(20)))
    assert bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    bm.commit(seq, 10)
    assert bm.allocate(seq, 10)
    seq.num_computed_tokens = 20
    bm.commit(seq, 20)
    h = hash_blocks(seq.token_ids, BS, seq.hash_extra)
    assert events == [BlockStored(h[:2], None), BlockStored(h[2:5], h[1])]


def test_duplicate_block_keeps_existing_entry() -> None:
    bm, events = make_bm(16)
    prompt = list(range(9))
    # Both admitted before either computed anything: no hits, both compute the same blocks.
    a, b = make_seq(prompt), make_seq(prompt)
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.commit(s, 9)
    h = hash_blocks(prompt, BS, a.hash_extra)
    assert events == [BlockStored(h, None)]  # only once
    assert [bm._cached[x] for x in h] == a.block_table[:2]
    check_invariants(bm, [a, b])
    bm.free(b)  # b's copies are private: they go back to the plain free list
    assert all(bm.blocks[x].hash is None for x in b.block_table)
    assert len(bm._evictable) == 0
    bm.free(a)
    assert len(bm._evictable) == 2
    check_invariants(bm, [])


def test_lru_eviction_order_and_events() -> None:
    bm, events = make_bm(6)
    a = make_seq(list(range(100, 108)))  # 2 full blocks
    b = make_seq(list(range(200, 208)))
    run_prefill(bm, a)
    run_prefill(bm, b)
    ha = hash_blocks(a.token_ids, BS, a.hash_extra)
    blocks_a, blocks_b = list(a.block_table), list(b.block_table)
    bm.free(a)  # released first -> least recently used; tail before head
    bm.free(b)
    assert list(bm._evictable) == [blocks_a[1], blocks_a[0], blocks_b[1], blocks_b[0]]
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    events.clear()
    # 2 plain free blocks are used first, then a's tail, then a's head.
    c = make_seq(list(range(300, 316)))
    assert bm.allocate(c, 16)
    assert set(c.block_table[2:]) == set(blocks_a)
    assert events == [BlockRemoved([ha[1], ha[0]])]
    assert bm.lookup(make_seq([*a.token_ids, 1])) == 0
    assert bm.lookup(make_seq([*b.token_ids, 1])) == 8  # b survived
    check_invariants(bm, [c])


def test_hit_revives_evictable_block_and_counts_it_against_the_pool() -> None:
    bm, _ = make_bm(4)
    prompt = list(range(9))  # 2 full blocks + 1
    a = make_seq(prompt)
    run_prefill(bm, a)
    bm.free(a)  # 2 evictable, 2 plain free
    b = make_seq([*prompt, 5, 6, 7, 8, 9, 10, 11, 12])  # 17 tokens: 8 hit, 9 new -> 3 more blocks
    assert bm.lookup(b) == 8
    # 4 free blocks, but 2 of them are the hits themselves: only 2 remain for new blocks.
    assert not bm.can_allocate(b, 9)
    assert not bm.allocate(b, 9)
    assert b.block_table == [] and len(bm._evictable) == 2
    assert bm.can_allocate(b, 8) and bm.allocate(b, 8)
    assert b.num_computed_tokens == 8 and len(b.block_table) == 4
    assert bm.num_free_blocks == 0 and len(bm._evictable) == 0
    check_invariants(bm, [b])


def test_prefix_caching_off() -> None:
    bm, events = make_bm(8, enable_prefix_caching=False)
    prompt = list(range(12))
    a = make_seq(prompt)
    run_prefill(bm, a)
    b = make_seq(prompt)
    assert bm.lookup(b) == 0
    run_prefill(bm, b)
    assert b.num_cached_tokens == 0
    assert a.block_hashes == [] and b.block_hashes == []  # nothing hashed
    assert events == [] and (bm.queries, bm.hits) == (0, 0)
    bm.free(a)
    bm.free(b)
    assert len(bm._evictable) == 0 and bm.num_free_blocks == 8


def test_reset_prefix_cache() -> None:
    bm, events = make_bm(8)
    a, b = make_seq(list(range(9))), make_seq(list(range(50, 59)))
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    events.clear()
    bm.reset_prefix_cache()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved) and len(events[0].hashes) == 4
    assert bm.num_cached_blocks == 0 and len(bm._evictable) == 0
    assert bm.lookup(make_seq(list(range(9)))) == 0
    check_invariants(bm, [b])
    bm.free(b)  # b's blocks are no longer cached: plain free
    assert bm.num_free_blocks == 8 and len(bm._evictable) == 0
    check_invariants(bm, [])


def test_reference_counts_with_many_sharers() -> None:
    bm, _ = make_bm(32)
    prompt = list(range(17))
    seqs = [make_seq(prompt) for _ in range(5)]
    for s in seqs:
        run_prefill(bm, s)
        check_invariants(bm, seqs)
    shared = seqs[0].block_table[:4]
    assert [bm.blocks[x].ref_count for x in shared] == [5] * 4
    for i, s in enumerate(seqs):
        bm.free(s)
        check_invariants(bm, seqs[i + 1 :])
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.num_free_blocks == 32
