"""Paged KV block allocator with a prefix cache.

Every block is in exactly one of three places:
- in use: ref_count > 0, listed in the block tables of running sequences;
- evictable: ref_count == 0 but still holding the KV of a cached hash; an LRU list (O(1)
  removal by id, oldest first), so a later request with the same prefix can take it back;
- free: ref_count == 0 and no hash.
Allocation takes free blocks first, then evicts the least recently used evictable block.

A block is in the prefix cache (`block.hash` set, `_cached[hash] == block_id`) only once all
its tokens' KV has been computed (`commit`), so a cache hit never reads unwritten KV. The
router learns about cache changes through `BlockStored` / `BlockRemoved` events.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.hashing import hash_blocks
from workers.engine.sequence import Sequence


@dataclass(slots=True)
class BlockStored:
    hashes: list[bytes]  # a chain: hashes[0] follows `parent`, hashes[i] follows hashes[i-1]
    parent: bytes | None


@dataclass(slots=True)
class BlockRemoved:
    hashes: list[bytes]


KVEvent = BlockStored | BlockRemoved


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while this block is the cache entry for that hash


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_event: Callable[[KVEvent], None] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self._committed: dict[int, int] = {}  # seq_id -> full blocks already offered to the cache
        self.queries = 0  # prompt tokens looked up in the prefix cache (first admissions)
        self.hits = 0  # of those, tokens served from the cache

    # --- state -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # --- prefix cache ------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to cover at least its first `num_blocks` full blocks."""
        hashes = seq.block_hashes
        have = len(hashes)
        if have < num_blocks:
            bs = self.block_size
            parent = hashes[-1] if hashes else None
            tokens = seq.token_ids[have * bs : num_blocks * bs]
            hashes.extend(hash_blocks(tokens, bs, seq.hash_extra, parent=parent))
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of a sequence that holds no blocks."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        # At least one token must be computed: its logits give the next token.
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup(self, seq: Sequence) -> int:
        """Tokens that `allocate` would take from the prefix cache for `seq` now (no side effects)."""
        return len(self._prefix_hits(seq)) * self.block_size

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Offer the blocks that became full (all KV computed) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = self._committed.get(seq.seq_id, 0)
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        self._committed[seq.seq_id] = end
        hashes = self._hashes(seq, end)
        run: list[bytes] = []  # a chain of newly stored hashes, one event per chain
        run_parent: bytes | None = None
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            h = hashes[i]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
                if not run:
                    run_parent = hashes[i - 1] if i else None
                run.append(h)
            elif run:
                # Another sequence computed the same block first: its entry stays, ours is
                # a private copy that goes back to the free list when released.
                self._emit(BlockStored(run, run_parent))
                run = []
        if run:
            self._emit(BlockStored(run, run_parent))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their KV but leave the cache)."""
        removed = list(self._cached)
        for block in self.blocks:
            block.hash = None
        self._cached.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        if removed:
            self._emit(BlockRemoved(removed))

    # --- allocation --------------------------------------------------------------------

    def _needed(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> tuple[int, int]:
        """(new blocks to take from the pool, evictable hit blocks that leave the pool)."""
        computed = seq.num_computed_tokens if seq.block_table else len(hits) * self.block_size
        need = _cdiv(computed + num_new_tokens, self.block_size) - len(seq.block_table) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return max(need, 0), revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need, revived = self._needed(seq, num_new_tokens, self._prefix_hits(seq))
        return need <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make `seq.block_table` cover `num_computed_tokens + num_new_tokens` tokens.

        A sequence without blocks first takes its cached prefix: `num_computed_tokens` becomes
        the hit tokens and `num_new_tokens` counts from there (see `lookup`). Returns False,
        changing nothing, if the pool is short.
        """
        fresh = not seq.block_table
        hits = self._prefix_hits(seq)
        need, revived = self._needed(seq, num_new_tokens, hits)
        if need > self.num_free_blocks - revived:
            return False
        if fresh:
            for block_id in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._evictable[block_id]
                block.ref_count += 1
            seq.block_table.extend(hits)
            hit_tokens = len(hits) * self.block_size
            seq.num_computed_tokens = hit_tokens
            if self.enable_prefix_caching:
                self._committed[seq.seq_id] = len(hits)
                if seq.num_preemptions == 0:  # a recompute is not a new prompt to count or bill
                    seq.num_cached_tokens = hit_tokens
                    self.queries += seq.num_prompt_tokens
                    self.hits += hit_tokens
        if need:
            seq.block_table.extend(self._take(need))
        return True

    def _take(self, n: int) -> list[int]:
        taken = []
        evicted = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                assert block.hash is not None
                del self._cached[block.hash]
                evicted.append(block.hash)
                block.hash = None
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        if evicted:
            self._emit(BlockRemoved(evicted))
        return taken

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones stay reusable until evicted."""
        # Reverse order: the tail blocks enter the LRU list first, so they are evicted before
        # the prefix blocks that other requests are more likely to share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table.clear()
        self._committed.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past a running sequence's first `num_tokens` tokens (the KV of
        rejected speculative tokens). Such blocks were taken for it alone and never committed
        (only blocks of computed tokens are), so they go straight back to the free list; KV left
        in the last kept block past `num_tokens` is never read and gets overwritten."""
        keep = _cdiv(num_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise RuntimeError(f"block {block_id} is shared or cached: it cannot be truncated")
            block.ref_count = 0
            self._free.append(block_id)
        del seq.block_table[keep:]

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
