"""One sequence being generated: its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tokenmill.hashing import extra_keys

if TYPE_CHECKING:
    from workers.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: sequences compare (and hash) by identity, so `list.remove`, sets and dicts
# never walk token lists, and two sequences with equal fields stay distinct.
@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens; only ever appended to
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache at first admission
    status: Status = Status.WAITING
    priority: int = 0  # lower runs first (0 interactive, 1 batch)
    # time.monotonic() when it arrived, was first scheduled and produced its first token (0.0:
    # not yet): a request's queueing, prefill and decode, for the worker's traces and metrics.
    arrival: float = 0.0
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    # The arrival of the first sequence of its burst (set by the scheduler): within a burst the
    # shortest prompt is admitted first (`SchedulerConfig.shortest_first_window`).
    cohort: float = 0.0
    cache_salt: str | None = None
    adapter_id: str | None = None
    fairness_key: str | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Chained hashes of full blocks computed so far (block manager's memo; valid because
    # token_ids only grow, and kept across preemption so a recompute does not rehash).
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: draft tokens to verify after the last token in the next step. Not in
    # token_ids (which only grow): the accepted ones are appended once verified.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_prefill(self) -> bool:
        """More than one token still to compute: the prompt, or a recompute after preemption."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def hash_extra(self) -> tuple[str | None, ...]:
        """What besides the tokens keys this sequence's blocks in the prefix cache."""
        return extra_keys(self.cache_salt, self.adapter_id)
