"""Virtual token counters (VTC): fair shares of the engine across fairness keys (tenants).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Every key has a
counter of the service it received: `prompt_weight` per prompt token computed plus
`output_weight` per token generated. The scheduler admits, within the best priority class,
the waiting sequence of the key with the least counter, so a key that floods the queue only
competes with its own requests, while the engine never idles if anything waits and fits.

No banking of idle credit: a key that starts waiting again is lifted to the least counter
among the keys already waiting (or, if nobody waits, to the counter of the key that left the
waiting set last), so an idle period does not turn into a burst that starves the others.
Counters only grow; keys that are gone and fully caught up are forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = str | None


@dataclass(slots=True)
class ServiceCounters:
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    counters: dict[Key, float] = field(default_factory=dict)
    waiting: dict[Key, int] = field(default_factory=dict)  # waiting sequences per key (> 0)
    unfinished: dict[Key, int] = field(default_factory=dict)  # waiting or running, per key (> 0)
    # Every waiting key's counter is >= floor (keys are lifted on joining and counters only
    # grow), so a key below it that holds no sequence can be dropped: it would be lifted anyway.
    floor: float = 0.0

    def __getitem__(self, key: Key) -> float:
        return self.counters.get(key, self.floor)

    def running(self, key: Key) -> int:
        return self.unfinished.get(key, 0) - self.waiting.get(key, 0)

    # --- membership ---------------------------------------------------------------------

    def add(self, key: Key) -> None:
        """A new sequence of `key` (it waits: call `wait` too)."""
        self.unfinished[key] = self.unfinished.get(key, 0) + 1

    def wait(self, key: Key) -> None:
        """A sequence of `key` joins the waiting set (new, or back after preemption)."""
        n = self.waiting.get(key, 0)
        if n == 0:
            if self.waiting:  # O(waiting keys), once per key per busy period
                self.floor = max(self.floor, min(self[k] for k in self.waiting))
            self.counters[key] = max(self[key], self.floor)
        self.waiting[key] = n + 1

    def unwait(self, key: Key) -> None:
        """A sequence of `key` leaves the waiting set (admitted, aborted or finished)."""
        n = self.waiting[key] - 1
        if n:
            self.waiting[key] = n
            return
        del self.waiting[key]
        if not self.waiting:
            self.floor = max(self.floor, self[key])

    def finish(self, key: Key) -> None:
        n = self.unfinished[key] - 1
        if n:
            self.unfinished[key] = n
            return
        del self.unfinished[key]
        # Amortised O(1): sweep only when gone keys outnumber the live ones.
        if len(self.counters) > 2 * len(self.unfinished) + 64:
            floor = self.floor
            self.counters = {k: c for k, c in self.counters.items() if k in self.unfinished or c > floor}

    # --- service ------------------------------------------------------------------------

    def charge(self, key: Key, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        if cost:
            self.counters[key] = self[key] + cost
