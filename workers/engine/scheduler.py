"""Iteration-level continuous batching under one token budget per step.

Each step's batch, in order: running decodes (one token each, so every stream keeps moving),
then running sequences still in prefill (their next chunk), then waiting sequences admitted
by (priority, arrival) while the token budget, `max_num_seqs` and the KV pool allow. Long
prompts are split into chunks across steps.

When a running sequence cannot get a block, the sequence admitted last — the newest of the
lowest priority, the reverse of admission order — is preempted by recompute: its blocks are
freed, `num_computed_tokens` goes back to 0 and it waits again under its old (priority,
arrival) key, which puts it ahead of everything that arrived after it. When rescheduled, all
its `token_ids` (prompt and generated) are computed again as one "prompt", mostly from the
prefix cache if its blocks were not evicted meanwhile.

The engine's step: `out = schedule()`, run the model on `out.batch`, sample for the sequences
whose `num_computed_tokens + num_new_tokens == len(token_ids)` (the prompt or recompute is
complete after this step; the others are mid-prefill and get no token), then
`update(out.batch, sampled)`, then `finish(seq, reason)` for those that stopped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, Status


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the token budget of one step
    long_prefill_threshold: int = 0  # max tokens of one prefill chunk; 0 = the whole budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.long_prefill_threshold < 0:
            raise ValueError(f"invalid scheduler config: {self}")


@dataclass(slots=True)
class SchedulerOutput:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num_new_tokens)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that cannot fit the whole KV pool even alone, finished with reason "length".
    # Only happens if prompt + max_tokens exceeds num_blocks * block_size; the engine should
    # still send them a final output.
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.batch)


def _admission_key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.running: list[Sequence] = []  # in admission order
        # A heap by admission key; aborted entries stay in it and are skipped when reached.
        self._waiting: list[tuple[int, float, int, Sequence]] = []
        self._num_waiting = 0
        self._by_request: dict[str, list[Sequence]] = {}  # n > 1 samples share a request id
        self.preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    # --- requests ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        bm = self.block_manager
        if seq.status is not Status.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError("only a fresh sequence can be added")
        if -(-seq.num_tokens // bm.block_size) > bm.num_blocks:
            raise ValueError(
                f"the prompt ({seq.num_tokens} tokens) exceeds the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size})"
            )
        self._push(seq)
        self._by_request.setdefault(seq.request_id, []).append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with reason "abort", freeing their blocks."""
        seqs = list(self._by_request.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def abort_seq(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (EOS, max_tokens, stop, abort...): free its blocks, drop it."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped when reached
        else:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        siblings = self._by_request.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._by_request[seq.request_id]

    # --- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chunk = cfg.long_prefill_threshold or budget

        # Running sequences: decodes first, then prefills in progress. A snapshot, because
        # preemption removes sequences from self.running as we go.
        running = list(self.running)
        for prefill in (False, True):
            for seq in running:
                if budget == 0:
                    break
                if seq.status is not Status.RUNNING or seq.is_prefill is not prefill:
                    continue
                n = min(seq.num_tokens - seq.num_computed_tokens, budget, chunk)
                if n == 0:
                    continue  # nothing new to compute (no token was sampled for it)
                fits, refund = self._make_room(seq, n, out)
                budget += refund
                if fits:
                    out.batch.append((seq, n))
                    budget -= n

        # Waiting sequences, unless this step already had to preempt (no room to grow).
        bm = self.block_manager
        while not out.preempted and self._waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self._waiting[0][-1]
            if seq.status is not Status.WAITING:  # aborted while waiting
                heapq.heappop(self._waiting)
                continue
            n = min(seq.num_tokens - bm.lookup(seq), budget, chunk)
            if not bm.allocate(seq, n):
                if self.running:
                    break  # blocks come back as running sequences finish
                # The whole pool is free and it still does not fit: it never will.
                self.finish(seq, "length")
                out.finished.append(seq)
                continue
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.batch.append((seq, n))
            budget -= n
        return out

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate blocks for `seq`'s next `n` tokens, preempting the last admitted sequences
        (possibly `seq` itself) until they fit. Returns (fits, tokens given back to the budget
        by victims already scheduled in this step)."""
        refund = 0
        while not self.block_manager.allocate(seq, n):
            victim = max(self.running, key=_admission_key)
            if victim is seq and len(self.running) == 1:
                # Alone with the whole pool and still short: it can never grow further.
                self.finish(seq, "length")
                out.finished.append(seq)
                return False, refund
            for i, (scheduled, tokens) in enumerate(out.batch):
                if scheduled is victim:
                    del out.batch[i]
                    refund += tokens
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False, refund
        return True, refund

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.preemptions += 1
        self._push(seq)

    def _push(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq.seq_id, seq))
        self._num_waiting += 1

    def update(self, batch: list[tuple[Sequence, int]], sampled: dict[int, int]) -> None:
        """Record a step's results: `sampled` maps seq_id to the new token of each sequence
        whose prompt (or recompute) completed in this step."""
        for seq, n in batch:
            if seq.status is not Status.RUNNING:
                continue  # finished (aborted) while the step ran: its blocks are gone
            seq.num_computed_tokens += n
            self.block_manager.commit(seq, seq.num_computed_tokens)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.token_ids.append(token)
