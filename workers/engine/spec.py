"""Speculative decoding's draft: n-gram prompt lookup.

The proposer needs no second model: when the last `n` tokens of a sequence (prompt and output)
occurred before, the tokens that followed that occurrence are guessed to follow again. It pays
off where outputs copy their context — "repeat this document with an edit", code edits,
quoting, extraction. The longest n in [min_n, max_n] with a match wins (a longer context is a
safer guess); among its matches, the most recent that is followed by k tokens (what the
sequence was last doing).

The engine verifies the k guesses in one forward pass over [last token, guesses...] and keeps
the longest prefix the target model agrees with (plus the target's own next token), so the
output is the same as without speculation; see `LLMEngine._verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(slots=True)
class NgramProposer:
    k: int  # most draft tokens per step
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.k < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"invalid n-gram proposer: {self}")

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default self.k) tokens guessed to follow `token_ids`; [] if no n-gram of
        the tail occurred before."""
        k = self.k if k is None else min(k, self.k)
        size = len(token_ids)
        if k < 1 or size <= self.min_n:
            return []
        # O(size * n) vectorised compares per n; sequences here are at most a few thousand tokens.
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows of n tokens that start before the tail and have at least one token after.
            windows = sliding_window_view(tokens[: size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if hits.size:
                # The most recent match followed by k tokens; else the earliest (the most tokens:
                # in a repeating pattern the latest match runs into the tail).
                full = hits[hits + n + k <= size]
                start = int(full[-1] if full.size else hits[0]) + n
                return token_ids[start : start + k]
        return []
