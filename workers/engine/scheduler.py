"""Iteration-level continuous batching under one token budget per step.

Each step's batch, in order: running decodes (one token each, so every stream keeps moving),
then prefill work — the next chunks of running sequences still in prefill, and waiting
sequences admitted while the token budget, `max_num_seqs` and the KV pool allow. Long prompts
are split into chunks across steps.

Admission order, policy "fair" (the default): the best (lowest) priority class first; within
it, the fairness key (tenant) that received the least service so far (virtual token counters,
see `fairness.py`); within the key, arrival order by bursts: the sequences that arrive within
`shortest_first_window` seconds of the first of a burst (its cohort) are admitted shortest
prompt first, which brings a burst's median time to first token down (64 prompts of 32-512
tokens at once: the shortest half no longer waits behind the longest ones) without letting a
prompt be overtaken by anything that arrived more than the window after it. Such a waiting
sequence also goes ahead of the next chunk of a running one of a worse class or a more-served
key. Policy "fcfs": (priority, arrival), after every running chunk. Both are
work-conserving: whoever waits and fits runs, whatever the counters say. The head chosen does
not get overtaken when it does not fit the KV pool: blocks come back as running sequences
finish, and letting smaller requests pass would starve large ones.

When a running sequence cannot get a block, a victim is preempted by recompute: from the
lowest priority class, the most-served key (fair; all keys are one under fcfs), its newest
sequence. Its blocks are freed, `num_computed_tokens` goes back to 0 and it waits again under
its old arrival (and burst), which puts it ahead of its key's later requests. When rescheduled, all its
`token_ids` (prompt and generated) are computed again as one "prompt", mostly from the prefix
cache if its blocks were not evicted meanwhile.

The engine's step: `out = schedule()`, run the model on `out.batch`, sample for the sequences
whose `num_computed_tokens + num_new_tokens == len(token_ids)` (the prompt or recompute is
complete after this step; the others are mid-prefill and get no token), then
`update(out.batch, sampled)`, then `finish(seq, reason)` for those that stopped.

Speculative decoding: a decode may carry draft tokens (`seq.spec_token_ids`, set by the engine
before `schedule`); they are scheduled after its last token when the budget and free blocks
allow (never by preempting anyone), and `update(..., accepted)` keeps the confirmed ones and
gives back the blocks that only the rejected ones used.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.fairness import Key, ServiceCounters
from workers.engine.sequence import Sequence, Status

POLICIES = ("fair", "fcfs")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the token budget of one step
    long_prefill_threshold: int = 0  # max tokens of one prefill chunk; 0 = the whole budget
    policy: str = "fair"  # admission across fairness keys: "fair" (VTC) | "fcfs"
    # Service a key is charged per prompt token computed and per token generated (the paper's
    # default: a generated token costs about two prompt tokens on a GPU).
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    # Seconds: a key's (and class's) waiting sequences that arrived within this long of the first
    # of their burst are admitted shortest first; 0 = strict arrival order (always so under fcfs).
    shortest_first_window: float = 1.0
    # Keys whose counters are within this much of the least one count as equally served, and
    # the one with the fewest sequences running goes first: a light tenant that just got one
    # request through does not then wait behind a flood that is a few tokens behind it. Fairness
    # holds up to this much service. None: one step's token budget.
    fairness_slack: float | None = None

    def __post_init__(self) -> None:
        if self.fairness_slack is None:
            self.fairness_slack = float(self.max_num_batched_tokens)
        if (
            self.max_num_seqs < 1
            or self.max_num_batched_tokens < 1
            or self.long_prefill_threshold < 0
            or self.policy not in POLICIES
            or self.prompt_weight < 0
            or self.output_weight < 0
            or self.fairness_slack < 0
            or self.shortest_first_window < 0
        ):
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


# A waiting sequence in its key's heap: (cohort, prompt tokens or 0, arrival, id, sequence).
_Entry = tuple[float, int, float, int, Sequence]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        admit: Callable[[Sequence], bool] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        # Whether a waiting sequence may start now (LoRA: its adapter got a slot); None = always.
        self.admit = admit
        self.running: list[Sequence] = []  # in admission order
        # priority class -> fairness key -> heap of its waiting sequences. Aborted entries stay
        # in their heap and are skipped when reached; empty heaps and classes are removed.
        self._queues: dict[int, dict[Key, list[_Entry]]] = {}
        self._num_waiting = 0
        self._fair = config.policy == "fair"
        self._slack = float(config.fairness_slack or 0.0)
        self._window = config.shortest_first_window if self._fair else 0.0
        # (class, key) -> the first arrival of its current burst (`shortest_first_window`)
        self._cohorts: dict[tuple[int, Key], float] = {}
        self.service = ServiceCounters(config.prompt_weight, config.output_weight)
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
        self.service.add(self._key(seq))
        if self._window:
            at = (seq.priority, self._key(seq))
            start = self._cohorts.get(at)
            if start is None or not seq.arrival - start < self._window:
                start = self._cohorts[at] = seq.arrival
            seq.cohort = start
        else:
            seq.cohort = seq.arrival
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
        key = self._key(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped when reached
            self.service.unwait(key)
        else:
            return
        self.service.finish(key)
        seq.spec_token_ids.clear()
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

        # Decodes first, one token each, so every stream keeps moving (plus the draft tokens
        # of speculative decoding, as the budget allows). A snapshot, because preemption
        # removes sequences from self.running as we go.
        running = list(self.running)
        decodes = sum(1 for seq in running if not seq.is_prefill)
        for seq in running:
            if budget == 0:
                break
            if seq.status is Status.RUNNING and not seq.is_prefill:
                decodes -= 1
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n and seq.spec_token_ids:
                    n += self._drafts(seq, n, budget - n - decodes)
                if n:  # 0: nothing new to compute (no token was sampled for it)
                    budget -= self._extend(seq, n, out)

        # Then prefill work: the next chunks of running sequences and admissions. Under fcfs
        # the running chunks go first, in admission order. Under fair, both go in fairness order
        # (class, then service): a light tenant's prompt is not split across steps behind a
        # heavy tenant's chunk.
        bm = self.block_manager
        chunks = [seq for seq in running if seq.status is Status.RUNNING and seq.is_prefill]
        admitting = True  # until this step preempts or the pool runs short
        skipped: list[_Entry] = []
        while budget > 0:
            # Drop those preempted to make room for an earlier chunk.
            chunks = [seq for seq in chunks if seq.status is Status.RUNNING]
            i = self._next_chunk(chunks) if chunks else 0
            head = None
            if admitting and not out.preempted and len(self.running) < cfg.max_num_seqs:
                entry = self._head()
                head = entry[-1] if entry is not None else None
            if head is None or (chunks and not self._ahead(head, chunks[i])):
                if not chunks:
                    break
                seq = chunks.pop(i)
                budget -= self._extend(seq, min(seq.num_tokens - seq.num_computed_tokens, budget, chunk), out)
                continue
            if self.admit is not None and not self.admit(head):
                # Its adapter has no slot until the running sequences of another one end; later
                # sequences whose adapters are resident (or that use none) go ahead meanwhile.
                skipped.append(self._pop(head))
                continue
            n = min(head.num_tokens - bm.lookup(head), budget, chunk)
            if not bm.allocate(head, n):
                if self.running:
                    admitting = False  # blocks come back as running sequences finish
                    continue
                # The whole pool is free and it still does not fit: it never will.
                self.finish(head, "length")
                out.finished.append(head)
                continue
            self._pop(head)
            self._num_waiting -= 1
            self.service.unwait(self._key(head))
            head.status = Status.RUNNING
            if not head.scheduled_at:  # a recompute after preemption keeps its first time
                head.scheduled_at = time.monotonic()
            self.running.append(head)
            out.batch.append((head, n))
            budget -= n
            # Charged now, not after the step, so the next pick of this loop sees it.
            self._charge_prefill(head, n)
        for entry in skipped:
            heapq.heappush(self._queue(entry[-1]), entry)
        return out

    def _drafts(self, seq: Sequence, n: int, room: int) -> int:
        """How many of a decode's draft tokens to verify with its `n` tokens: what `room` leaves
        (the budget, less a token for every decode still to schedule) and the free blocks hold.
        Drafts never preempt anything; those left out are dropped."""
        k = min(len(seq.spec_token_ids), max(room, 0))
        if k and not self.block_manager.allocate(seq, n + k):
            k = 0
        del seq.spec_token_ids[k:]
        return k

    def _extend(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Schedule `n` more tokens of a running sequence if room can be made; returns the
        budget this used (less what preempted victims already scheduled gave back)."""
        fits, refund = self._make_room(seq, n, out)
        if not fits:
            return -refund
        out.batch.append((seq, n))
        self._charge_prefill(seq, n)
        return n - refund

    # --- waiting queues ----------------------------------------------------------------

    def _key(self, seq: Sequence) -> Key:
        return seq.fairness_key if self._fair else None

    def _queue(self, seq: Sequence) -> list[_Entry]:
        return self._queues.setdefault(seq.priority, {}).setdefault(self._key(seq), [])

    def _head(self) -> _Entry | None:
        """The next waiting sequence: best priority class; least-served key (within the slack,
        the one with the fewest sequences running; see `fairness_slack`); earliest arrival.
        O(priority classes + waiting keys)."""
        service = self.service
        slack = self._slack
        for priority in sorted(self._queues):
            queues = self._queues[priority]
            while queues:
                if len(queues) == 1:
                    key = next(iter(queues))
                else:
                    bound = min(service[k] for k in queues) + slack
                    key = min(
                        (k for k in queues if service[k] <= bound),
                        key=lambda k: (service.running(k), service[k], queues[k][0][:-1]),
                    )
                heap = queues[key]
                while heap and heap[0][-1].status is not Status.WAITING:
                    heapq.heappop(heap)  # aborted while waiting
                if heap:
                    return heap[0]
                del queues[key]
                self._cohorts.pop((priority, key), None)
            del self._queues[priority]
        return None

    def _pop(self, seq: Sequence) -> _Entry:
        """Take `seq`, the head returned by `_head`, out of its heap."""
        queues = self._queues[seq.priority]
        key = self._key(seq)
        entry = heapq.heappop(queues[key])
        if not queues[key]:
            del queues[key]
            self._cohorts.pop((seq.priority, key), None)
            if not queues:
                del self._queues[seq.priority]
        return entry

    def _charge_prefill(self, seq: Sequence, n: int, sign: int = 1) -> None:
        """Charge the prompt tokens among the `n` about to be computed. A recompute after
        preemption is not charged again: the scheduler chose it, not the tenant."""
        if seq.num_preemptions == 0:
            c = seq.num_computed_tokens
            prompt = min(c + n, seq.num_prompt_tokens) - c
            if prompt > 0:
                self.service.charge(self._key(seq), prompt_tokens=sign * prompt)

    def _next_chunk(self, chunks: list[Sequence]) -> int:
        """Which running prefill goes next: the first under fcfs; under fair, as `_head` orders
        keys (class; within the slack of the least served, fewest running), then admission."""
        if not self._fair or len(chunks) == 1:
            return 0
        s = self.service
        least: dict[int, float] = {}
        for seq in chunks:
            c = s[self._key(seq)]
            least[seq.priority] = min(least.get(seq.priority, c), c)

        def rank(i: int) -> tuple[int, bool, int, float, int]:
            seq = chunks[i]
            key = self._key(seq)
            near = s[key] <= least[seq.priority] + self._slack
            return (seq.priority, not near, s.running(key) if near else 0, s[key], i)

        return min(range(len(chunks)), key=rank)

    def _ahead(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether a waiting sequence's admission goes before a running one's next chunk."""
        if not self._fair:
            return False
        if waiting.priority != running.priority:
            return waiting.priority < running.priority
        s = self.service
        a, b = self._key(waiting), self._key(running)
        if abs(s[a] - s[b]) > self._slack:
            return s[a] < s[b]
        return (s.running(a), s[a]) < (s.running(b), s[b])

    def _victim_key(self, seq: Sequence) -> tuple[int, float, float, int]:
        return (seq.priority, self.service[self._key(seq)], seq.arrival, seq.seq_id)

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate blocks for `seq`'s next `n` tokens, preempting the last admitted sequences
        (possibly `seq` itself) until they fit. Returns (fits, tokens given back to the budget
        by victims already scheduled in this step)."""
        refund = 0
        while not self.block_manager.allocate(seq, n):
            victim = max(self.running, key=self._victim_key)
            if victim is seq and len(self.running) == 1:
                # Alone with the whole pool and still short: it can never grow further.
                self.finish(seq, "length")
                out.finished.append(seq)
                return False, refund
            for i, (scheduled, tokens) in enumerate(out.batch):
                if scheduled is victim:
                    del out.batch[i]
                    refund += tokens
                    self._charge_prefill(victim, tokens, sign=-1)
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False, refund
        return True, refund

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.preemptions += 1
        self._push(seq)

    def _push(self, seq: Sequence) -> None:
        size = seq.num_tokens if self._window else 0
        heapq.heappush(self._queue(seq), (seq.cohort, size, seq.arrival, seq.seq_id, seq))
        self._num_waiting += 1
        self.service.wait(self._key(seq))

    def update(
        self,
        batch: list[tuple[Sequence, int]],
        sampled: dict[int, int],
        accepted: dict[int, int] | None = None,
    ) -> None:
        """Record a step's results: `sampled` maps seq_id to the new token of each sequence
        whose prompt (or recompute) completed in this step; `accepted`, to how many of a
        sequence's draft tokens (`spec_token_ids`, verified in this step) the model confirmed:
        those come before the sampled token, and the KV of the rejected ones is dropped."""
        for seq, n in batch:
            if seq.status is not Status.RUNNING:
                continue  # finished (aborted) while the step ran: its blocks are gone
            drafts = seq.spec_token_ids
            if drafts:
                m = accepted.get(seq.seq_id, 0) if accepted else 0
                seq.token_ids.extend(drafts[:m])
                self.service.charge(self._key(seq), output_tokens=m)
                seq.num_computed_tokens += n - (len(drafts) - m)
                if m < len(drafts):  # blocks past the confirmed tokens hold only rejected KV
                    self.block_manager.truncate(seq, seq.num_computed_tokens)
                drafts.clear()
            else:
                seq.num_computed_tokens += n
            self.block_manager.commit(seq, seq.num_computed_tokens)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.token_ids.append(token)
                self.service.charge(self._key(seq), output_tokens=1)
