"""The scaling policy: a pure function from fleet metrics to a desired replica count.

Modelled on Knative's KPA. Concurrency (running + waiting requests) averaged over a long
*stable* window sets the replica count; the same average over a short *panic* window
catches bursts: when it asks for `panic_threshold` times the current fleet, the policy
panics, scales up at once and refuses to scale down until the burst has been gone a whole
stable window. Observed TTFT above its target adds pressure on top of concurrency, and
KV-cache usage near full does the same. Serverless deployments (min 0) go to zero after
a grace period without traffic; a waiting request wakes them.

Two optional inputs go beyond the KPA:

- The arrival rate (`Sample.arrival_rate`, with `target_rate`): concurrency lags arrivals
  by a service time, and while new replicas start it grows with the queue rather than with
  the demand, so each window also asks for rate / `target_rate` replicas (Little's law).
  With `drain_time` set, the arrival rate also bounds what concurrency may ask for: the
  requests beyond those arrivals keep in flight are a backlog, which needs the replicas
  that drain it within `drain_time` (rate + waiting / drain_time, over `target_rate`), not
  one replica per `target_concurrency` of it; a backlog queued behind busy replicas
  otherwise starts a fleet that mostly idles.
- A seasonal forecast (`forecast`, off by default): from the samples it is given (hours of
  them), the policy looks for a period in the arrival rate by autocorrelation, and when one
  repeats clearly enough it provisions now for the rate seen one period ago over the next
  `forecast_lead` seconds, so that replicas are warm when a recurring burst comes back.
  Nothing about the period is configured: it is learned, and only trusted once the
  samples cover it twice.

No I/O and no clock reads: the caller passes `now` and the state returned by the
previous call, so every rule can be tested with a table of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    target_concurrency: float = 8.0  # running + waiting requests one replica should carry
    target_rate: float | None = None  # requests/s one replica should take; None: concurrency alone
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
    # With a target rate: concurrency asks for no more than the arrival rate needs plus what
    # draining the waiting queue within this many seconds needs. None: no cap.
    drain_time: float | None = None
    forecast: bool = False  # pre-scale for a learned seasonal pattern (needs target_rate)
    forecast_lead: float = 60.0  # provision now for the rate expected this far ahead: > cold start
    season_min: float = 60.0  # shortest period looked for, seconds
    season_max: float = 86400.0  # longest (also bounded by half the samples' span)
    # Autocorrelation at the period needed to trust it. Poisson noise in a series only a
    # few minutes long reaches ~0.7 at its best lag; a real burst pattern ~0.95.
    season_corr: float = 0.8
    season_bucket: float = 10.0  # the arrival-rate series is averaged over buckets this long

    def __post_init__(self) -> None:
        # Every target divides a load: a zero one would ask for infinitely many replicas (and
        # did: a ZeroDivisionError in `_want`). Refused here, whoever builds the config.
        if not self.target_concurrency > 0:
            raise ValueError(f"target_concurrency must be above 0, not {self.target_concurrency}")
        for name in ("target_rate", "target_ttft", "drain_time"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be above 0 (or unset), not {value}")
        for name in ("stable_window", "panic_window", "season_bucket"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, not {getattr(self, name)}")


@dataclass(slots=True, frozen=True)
class Sample:
    ts: float
    running: int
    waiting: int
    kv_usage: float = 0.0  # 0..1, mean over the fleet
    ttft_p95: float | None = None  # over requests that got their first token since the last sample
    arrival_rate: float | None = None  # requests/s that arrived since the last sample


@dataclass(slots=True, frozen=True)
class PolicyState:
    last_change: float = -math.inf  # when the desired count last moved
    panic_until: float = -math.inf
    last_traffic: float = -math.inf  # last sample with any running or waiting request


@dataclass(slots=True, frozen=True)
class Season:
    period: float  # seconds
    corr: float  # autocorrelation of the arrival rate at that lag
    rate: float  # requests/s expected over the next forecast_lead seconds


@dataclass(slots=True, frozen=True)
class Decision:
    desired: int
    panic: bool
    reason: str
    state: PolicyState
    season: Season | None = None  # the forecast used, when one was trusted


def _want(samples: Sequence[Sample], config: PolicyConfig) -> tuple[int, str]:
    """Replicas wanted by the mean concurrency of `samples` and, given a target rate, by
    their mean arrival rate; and why."""
    if not samples:
        return 0, "no samples"
    conc = sum(s.running + s.waiting for s in samples) / len(samples)
    want, why = math.ceil(conc / config.target_concurrency - 1e-9), f"mean {conc:.1f}"
    rates = [s.arrival_rate for s in samples if s.arrival_rate is not None]
    if config.target_rate and rates:
        rate = sum(rates) / len(rates)
        by_rate = math.ceil(rate / config.target_rate - 1e-9)
        if config.drain_time is not None:
            # Concurrency beyond what the arrivals keep in flight is a backlog: it needs the
            # replicas that drain it in drain_time, not one per target_concurrency of it.
            waiting = sum(s.waiting for s in samples) / len(samples)
            cap = math.ceil((rate + waiting / config.drain_time) / config.target_rate - 1e-9)
            if want > cap:
                want, why = cap, f"mean rate {rate:.2f}/s + drain {waiting:.1f} waiting"
        if by_rate > want:
            want, why = by_rate, f"mean rate {rate:.2f}/s"
    return want, why


def _rate_series(samples: Sequence[Sample], now: float, bucket: float) -> tuple[np.ndarray, float]:
    """The arrival rate averaged over `bucket`-second buckets (a bucket without a sample
    repeats the one before), and the start of the first bucket."""
    # Flat passes in C: this runs on hours of samples at every call. None becomes NaN.
    ts = np.fromiter(map(attrgetter("ts"), samples), float, len(samples))
    rate = np.array(list(map(attrgetter("arrival_rate"), samples)), dtype=float)
    keep = ~np.isnan(rate) & (ts <= now)
    ts, rate = ts[keep], rate[keep]
    if not len(ts):
        return np.zeros(0), now
    start = float(ts.min())
    idx = ((ts - start) // bucket).astype(np.int64)
    n = int(idx.max()) + 1
    counts = np.bincount(idx, minlength=n)
    sums = np.bincount(idx, weights=rate, minlength=n)
    filled = np.nonzero(counts)[0]
    # Index of the last bucket at or before each one that has samples (the first always does).
    last = filled[np.searchsorted(filled, np.arange(n), side="right") - 1]
    return sums[last] / counts[last], start


def find_period(x: np.ndarray, lo: int, hi: int) -> tuple[int, float]:
    """The lag in [lo, hi] (in samples of `x`; the series must cover it twice) at which `x`,
    less its linear trend, best correlates with itself, and that Pearson correlation over the
    overlap; (0, 0.0) when there is none. Only peaks count (a correlation still falling from
    lag 0, as a smooth series has, is no period), and since multiples of a period correlate
    about as well as the period, the shortest peak within 0.05 of the best wins."""
    n = len(x)
    lo, hi = max(lo, 2), min(hi, n // 2 - 1)  # each lag needs a neighbour on either side
    if hi < lo:
        return 0, 0.0
    t = np.arange(n, dtype=float)
    x = x - np.polyval(np.polyfit(t, x, 1), t)  # a trend is not a season
    lags = np.arange(lo - 1, hi + 2)
    cs, cs2 = np.concatenate(([0.0], np.cumsum(x))), np.concatenate(([0.0], np.cumsum(x * x)))
    m = n - lags  # overlap length at each lag: x[:m] against x[lag:]
    sa, sb = cs[m], cs[n] - cs[lags]
    saa, sbb = cs2[m], cs2[n] - cs2[lags]
    # sum(x[i] * x[i + lag]) for every lag at once, by FFT.
    f = np.fft.rfft(x, 2 * n)
    sab = np.fft.irfft(f * np.conj(f), 2 * n)[lags]
    cov = sab - sa * sb / m
    var = (saa - sa * sa / m) * (sbb - sb * sb / m)
    ok = var > 1e-12 * max(float(cs2[n]), 1e-12) ** 2  # a flat series correlates with nothing
    r = np.where(ok, cov / np.sqrt(np.where(ok, var, 1.0)), 0.0)
    inner = r[1:-1]
    peak = (inner > r[:-2]) & (inner >= r[2:])
    if not peak.any():
        return 0, 0.0
    best = int(np.nonzero(peak & (inner >= inner[peak].max() - 0.05))[0][0])
    return int(lags[best + 1]), float(inner[best])


def seasonal_forecast(config: PolicyConfig, samples: Sequence[Sample], now: float) -> Season | None:
    """The arrival rate expected over [now, now + forecast_lead]: the highest rate seen over
    the same stretch one learned period ago, when the samples show a period clearly."""
    b = config.season_bucket
    x, start = _rate_series(samples, now, b)
    lag, corr = find_period(x, math.ceil(config.season_min / b), math.floor(config.season_max / b))
    if not lag or corr < config.season_corr:
        return None
    period = lag * b
    first = math.floor((now - period - start) / b)
    last = math.floor((now - period + config.forecast_lead - start) / b)
    window = x[max(first, 0) : min(last, len(x) - 1) + 1]
    return Season(period, corr, float(window.max())) if len(window) else None


def decide(
    config: PolicyConfig,
    samples: Sequence[Sample],
    current: int,
    state: PolicyState,
    now: float,
) -> Decision:
    """Desired replicas for a deployment that has `current` (ready or starting) now.

    `samples` need only cover the stable window; with `forecast` on, pass hours of them:
    the seasonal forecast learns from everything it is given."""
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

    want, why = _want(stable, config)
    panic_want, panic_why = _want(recent, config)
    reason = f"stable {why}"

    # TTFT above target means the concurrency target is too loose for this load: grow the
    # fleet in proportion to the miss, capped so one slow sample cannot max it out.
    ttfts = [s.ttft_p95 for s in recent if s.ttft_p95 is not None]
    if config.target_ttft is not None and ttfts and max(ttfts) > config.target_ttft:
        ratio = min(max(ttfts) / config.target_ttft, config.ttft_max_step)
        pressed = math.ceil(max(current, 1) * ratio)
        if pressed > want:
            want, reason = pressed, f"ttft p95 {max(ttfts):.2f}s > {config.target_ttft}s"
    # A nearly full KV cache preempts sequences before the queue shows it. Once requests
    # wait, the queue shows it: concurrency and arrivals already count that demand, and
    # adding a replica a call on top of them would grow the fleet for as long as it waits.
    if latest.kv_usage > config.kv_high and not latest.waiting and current + 1 > want:
        want, reason = current + 1, f"kv usage {latest.kv_usage:.0%}"

    # A recurring burst is served by replicas started a cold start before it, which reacting
    # to it cannot do. The forecast only adds replicas; it never holds back a scale-up.
    season = seasonal_forecast(config, samples, now) if config.forecast and config.target_rate else None
    if season is not None and config.target_rate:
        ahead = math.ceil(season.rate / config.target_rate - 1e-9)
        if ahead > want:
            want, reason = ahead, f"forecast {season.rate:.2f}/s (period {season.period:g}s)"

    if panic_want >= config.panic_threshold * max(current, 1) and panic_want > current:
        state = replace(state, panic_until=now + config.stable_window)
    panic = now < state.panic_until
    if panic:
        # Scale straight to the burst; never down until a stable window without one.
        if panic_want > want:
            want, reason = panic_want, f"panic {panic_why}"
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
    return Decision(desired, panic, reason, state, season)
