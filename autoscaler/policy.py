"""The scaling policy: a pure function from fleet metrics to a desired replica count.

Modelled on Knative's KPA. Concurrency (running + waiting requests) averaged over a long
*stable* window sets the replica count; the same average over a short *panic* window
catches bursts: when it asks for `panic_threshold` times the current fleet, the policy
panics, scales up at once and refuses to scale down until the burst has been gone a whole
stable window. Observed TTFT above its target adds pressure on top of concurrency, and
KV-cache usage near full does the same. Serverless deployments (min 0) go to zero after
a grace period without traffic; a waiting request wakes them.

No I/O and no clock reads: the caller passes `now` and the state returned by the
previous call, so every rule can be tested with a table of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    target_concurrency: float = 8.0  # running + waiting requests one replica should carry
    target_ttft: float | None = None  # seconds, p95; None: concurrency alone decides
    stable_window: float = 60.0
    panic_window: float = 6.0
    panic_threshold: float = 2.0  # panic when the panic window wants this × current replicas
    min_replicas: int = 1
    max_replicas: int = 10
    scale_down_cooldown: float = 30.0  # since the last change, before any scale-down
    scale_to_zero_grace: float = 300.0  # idle time before a min-0 deployment goes to zero
    ttft_max_step: float = 2.0  # TTFT pressure grows the fleet by at most this factor per call
    kv_high: float = 0.9  # KV usage above this counts as one more replica's worth of demand


@dataclass(slots=True, frozen=True)
class Sample:
    ts: float
    running: int
    waiting: int
    kv_usage: float = 0.0  # 0..1, mean over the fleet
    ttft_p95: float | None = None  # over requests that got their first token since the last sample


@dataclass(slots=True, frozen=True)
class PolicyState:
    last_change: float = -math.inf  # when the desired count last moved
    panic_until: float = -math.inf
    last_traffic: float = -math.inf  # last sample with any running or waiting request


@dataclass(slots=True, frozen=True)
class Decision:
    desired: int
    panic: bool
    reason: str
    state: PolicyState


def _want(samples: Sequence[Sample], target: float) -> tuple[int, float]:
    """Replicas wanted by the mean concurrency of `samples`, and that mean."""
    if not samples:
        return 0, 0.0
    mean = sum(s.running + s.waiting for s in samples) / len(samples)
    return math.ceil(mean / target - 1e-9), mean


def decide(
    config: PolicyConfig,
    samples: Sequence[Sample],
    current: int,
    state: PolicyState,
    now: float,
) -> Decision:
    """Desired replicas for a deployment that has `current` (ready or starting) now."""
    stable = [s for s in samples if now - config.stable_window < s.ts <= now]
    recent = [s for s in stable if now - config.panic_window < s.ts]
    if not stable:
        # No metrics (a fresh deployment, or a gap in scraping): hold, within bounds.
        desired = min(max(current, config.min_replicas), config.max_replicas)
        return Decision(desired, False, "no samples: hold", state)

    latest = max(stable, key=lambda s: s.ts)
    busy = [s.ts for s in stable if s.running + s.waiting > 0]
    if busy:
        state = replace(state, last_traffic=max(state.last_traffic, *busy))

    stable_want, stable_mean = _want(stable, config.target_concurrency)
    panic_want, panic_mean = _want(recent, config.target_concurrency)
    want, reason = stable_want, f"stable mean {stable_mean:.1f}"

    # TTFT above target means the concurrency target is too loose for this load: grow the
    # fleet in proportion to the miss, capped so one slow sample cannot max it out.
    ttfts = [s.ttft_p95 for s in recent if s.ttft_p95 is not None]
    if config.target_ttft is not None and ttfts and max(ttfts) > config.target_ttft:
        ratio = min(max(ttfts) / config.target_ttft, config.ttft_max_step)
        pressed = math.ceil(max(current, 1) * ratio)
        if pressed > want:
            want, reason = pressed, f"ttft p95 {max(ttfts):.2f}s > {config.target_ttft}s"
    # A nearly full KV cache preempts sequences before the queue shows it.
    if latest.kv_usage > config.kv_high and current + 1 > want:
        want, reason = current + 1, f"kv usage {latest.kv_usage:.0%}"

    if panic_want >= config.panic_threshold * max(current, 1) and panic_want > current:
        state = replace(state, panic_until=now + config.stable_window)
    panic = now < state.panic_until
    if panic:
        # Scale straight to the burst; never down until a stable window without one.
        if panic_want > want:
            want, reason = panic_want, f"panic mean {panic_mean:.1f}"
        want = max(want, current)
        reason = f"panic: {reason}"

    if config.min_replicas == 0 and want == 0 and now - state.last_traffic < config.scale_to_zero_grace:
        want, reason = min(current, 1), f"{reason}; idle < grace"
    if latest.waiting > 0 and want < 1:
        want, reason = 1, "waiting request wakes the deployment"

    desired = min(max(want, config.min_replicas), config.max_replicas)
    if desired < current and not panic and now - state.last_change < config.scale_down_cooldown:
        desired, reason = current, f"{reason}; scale-down cooldown"
    if desired != current:
        state = replace(state, last_change=now)
    return Decision(desired, panic, reason, state)
