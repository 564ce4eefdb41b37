"""The scaling policy, one rule at a time: each case is a series of samples and an answer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autoscaler.policy import (
    Decision,
    PolicyConfig,
    PolicyState,
    Sample,
    _rate_series,
    decide,
    find_period,
    seasonal_forecast,
)

CFG = PolicyConfig(target_concurrency=10, min_replicas=1, max_replicas=20, scale_down_cooldown=30)


def steady(conc: int, until: float, start: float = 0.0, step: float = 2.0) -> list[Sample]:
    """Samples every `step` seconds with `conc` running requests."""
    n = int((until - start) / step)
    return [Sample(ts=start + step * (i + 1), running=conc, waiting=0) for i in range(n)]


@pytest.mark.parametrize(
    ("conc", "current", "desired", "panic"),
    [
        (0, 1, 1, False),
        (10, 1, 1, False),
        (11, 1, 2, True),  # wants 2 = 2 × current: a step from 1 replica panics
        (35, 3, 4, False),
        (35, 2, 4, True),
        (40, 4, 4, False),
        (1000, 5, 20, True),
    ],
)
def test_steady_load_wants_ceil_of_concurrency_over_target(
    conc: int, current: int, desired: int, panic: bool
) -> None:
    d = decide(CFG, steady(conc, 120), current, PolicyState(), now=120)
    assert d.desired == desired
    assert d.panic is panic


def test_waiting_counts_as_concurrency() -> None:
    samples = [Sample(ts=t, running=10, waiting=15) for t in range(2, 121, 2)]
    assert decide(CFG, samples, 1, PolicyState(), now=120).desired == 3


@pytest.mark.parametrize(("burst", "panic"), [(19, False), (40, True), (100, True)])
def test_burst_in_the_panic_window(burst: int, panic: bool) -> None:
    # 2 replicas at 20 for a minute, then the last 6 s at `burst` each sample: the stable
    # mean barely moves, the panic mean asks for ceil(burst / 10).
    samples = steady(20, 114) + steady(burst, 120, start=114)
    d = decide(CFG, samples, 2, PolicyState(), now=120)
    assert d.panic is panic
    if panic:
        assert d.desired == -(-burst // 10)
        assert d.state.panic_until == 120 + CFG.stable_window
    else:
        assert d.desired == 2


def test_no_scale_down_while_panicking() -> None:
    state = PolicyState(panic_until=200, last_change=0)
    d = decide(CFG, steady(5, 150), 8, state, now=150)
    assert d.panic
    assert d.desired == 8
    after = decide(CFG, steady(5, 250, start=150), 8, state, now=250)
    assert not after.panic
    assert after.desired == 1


@pytest.mark.parametrize(("last_change", "desired"), [(100, 5), (90.5, 5), (90, 1), (0, 1)])
def test_scale_down_waits_for_the_cooldown(last_change: float, desired: int) -> None:
    d = decide(CFG, steady(5, 120), 5, PolicyState(last_change=last_change), now=120)
    assert d.desired == desired
    assert d.state.last_change == (120 if desired != 5 else last_change)


def test_scale_up_ignores_the_cooldown() -> None:
    d = decide(CFG, steady(50, 120), 2, PolicyState(last_change=119), now=120)
    assert d.desired == 5


@pytest.mark.parametrize(
    ("lo", "hi", "conc", "desired"), [(2, 6, 0, 2), (2, 6, 35, 4), (2, 6, 500, 6), (3, 3, 500, 3)]
)
def test_min_max_clamp(lo: int, hi: int, conc: int, desired: int) -> None:
    cfg = PolicyConfig(target_concurrency=10, min_replicas=lo, max_replicas=hi)
    assert decide(cfg, steady(conc, 120), 4, PolicyState(), now=120).desired == desired


ZERO = PolicyConfig(target_concurrency=10, min_replicas=0, max_replicas=5, scale_to_zero_grace=300)


@pytest.mark.parametrize(("last_traffic", "desired"), [(100, 1), (200, 1), (-181, 0), (-1e9, 0)])
def test_scale_to_zero_after_the_grace(last_traffic: float, desired: int) -> None:
    # Idle for the whole stable window; traffic last seen at `last_traffic`.
    d = decide(ZERO, steady(0, 120), 1, PolicyState(last_traffic=last_traffic), now=120)
    assert d.desired == desired


def test_traffic_in_the_window_resets_the_grace() -> None:
    samples = [*steady(0, 100), Sample(ts=102, running=1, waiting=0), *steady(0, 120, start=102)]
    d = decide(ZERO, samples, 1, PolicyState(last_traffic=-1e9), now=120)
    assert d.desired == 1
    assert d.state.last_traffic == 102


def test_a_waiting_request_wakes_a_zero_deployment() -> None:
    samples = [*steady(0, 118), Sample(ts=120, running=0, waiting=1)]
    d = decide(ZERO, samples, 0, PolicyState(last_traffic=-1e9), now=120)
    assert d.desired == 1
    assert d.state.last_change == 120


def test_zero_stays_zero_without_traffic() -> None:
    assert decide(ZERO, steady(0, 120), 0, PolicyState(), now=120).desired == 0


TTFT = PolicyConfig(target_concurrency=10, target_ttft=1.0, max_replicas=20, ttft_max_step=2.0)


@pytest.mark.parametrize(("ttft", "desired"), [(None, 2), (0.9, 2), (1.5, 6), (9.0, 8)])
def test_ttft_above_target_adds_pressure(ttft: float | None, desired: int) -> None:
    # Concurrency alone wants 2; TTFT over target grows the 4 current by the miss, at most 2×.
    samples = [*steady(20, 118), Sample(ts=120, running=20, waiting=0, ttft_p95=ttft)]
    assert decide(TTFT, samples, 4, PolicyState(last_change=0), now=120).desired == desired


def test_full_kv_cache_adds_a_replica() -> None:
    samples = [*steady(20, 118), Sample(ts=120, running=20, waiting=0, kv_usage=0.95)]
    assert decide(CFG, samples, 2, PolicyState(), now=120).desired == 3


def test_a_full_kv_cache_adds_nothing_once_requests_wait() -> None:
    # While requests wait, concurrency (mean 20.2, target 10) counts the demand: 3, not 5 + 1.
    samples = [*steady(20, 118), Sample(ts=120, running=20, waiting=5, kv_usage=0.95)]
    assert decide(CFG, samples, 5, PolicyState(), now=120).desired == 3
    # Before they do, the full cache is the only sign: one more replica.
    no_queue = [*samples[:-1], replace(samples[-1], waiting=0)]
    assert decide(CFG, no_queue, 5, PolicyState(), now=120).desired == 6


def test_no_samples_holds_within_bounds() -> None:
    assert decide(CFG, [], 0, PolicyState(), now=5) == Decision(1, False, "no samples: hold", PolicyState())
    assert decide(CFG, [], 30, PolicyState(), now=5).desired == 20


def test_samples_outside_the_window_are_ignored() -> None:
    samples = steady(100, 50) + steady(10, 200, start=140)
    assert decide(CFG, samples, 1, PolicyState(), now=200).desired == 1


def test_decide_is_pure() -> None:
    samples = steady(50, 120)
    state = PolicyState()
    first = decide(CFG, samples, 2, state, now=120)
    assert decide(CFG, samples, 2, state, now=120) == first
    assert state == PolicyState()


@pytest.mark.parametrize(
    "bad",
    [
        {"target_concurrency": 0},  # what bench/autoscale_sim.py's calibration once set: a ZeroDivisionError
        {"target_concurrency": -1},
        {"target_concurrency": float("nan")},
        {"target_rate": 0.0},
        {"target_ttft": -0.5},
        {"drain_time": 0},
        {"stable_window": 0},
        {"season_bucket": 0},
    ],
)
def test_a_target_of_zero_or_less_is_refused(bad: dict[str, float]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name} must be above 0"):
        PolicyConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        replace(CFG, **bad)  # the bench builds its config this way


# --- arrival rate (Little's law) ------------------------------------------------------------

RATE = PolicyConfig(target_concurrency=10, target_rate=1.0, min_replicas=1, max_replicas=20)


def arriving(conc: int, rate: float | None, until: float, start: float = 0.0) -> list[Sample]:
    """Samples every 2 s with `conc` running requests and `rate` arrivals per second."""
    return [replace(s, arrival_rate=rate) for s in steady(conc, until, start)]


@pytest.mark.parametrize(("rate", "desired"), [(None, 1), (0.5, 1), (3.5, 4), (12.0, 12)])
def test_the_arrival_rate_asks_for_rate_over_target_rate(rate: float | None, desired: int) -> None:
    # Concurrency alone (5, target 10) wants 1; arrivals want ceil(rate / 1 req/s).
    assert decide(RATE, arriving(5, rate, 120), 1, PolicyState(), now=120).desired == desired


def test_concurrency_still_counts_when_it_asks_for_more() -> None:
    assert decide(RATE, arriving(45, 1.0, 120), 1, PolicyState(), now=120).desired == 5


def test_without_a_target_rate_arrivals_are_ignored() -> None:
    assert decide(CFG, arriving(5, 50.0, 120), 1, PolicyState(), now=120).desired == 1


def test_a_jump_in_arrivals_panics_before_concurrency_moves() -> None:
    # Concurrency flat at 10 on 2 replicas; arrivals go from 1.5/s to 10/s in the last 6 s.
    samples = arriving(10, 1.5, 114) + arriving(10, 10.0, 120, start=114)
    d = decide(RATE, samples, 2, PolicyState(), now=120)
    assert d.panic
    assert d.desired == 10


def backlog(waiting: int, rate: float, until: float = 120) -> list[Sample]:
    """Samples every 2 s with 10 running, `waiting` queued and `rate` arrivals per second."""
    return [replace(s, waiting=waiting) for s in arriving(10, rate, until)]


@pytest.mark.parametrize(
    ("drain_time", "desired"),
    [
        (None, 20),  # concurrency 610 over target 10: 61, clamped to max
        (60.0, 14),  # 4 req/s + 600 waiting drained in 60 s: 14 req/s at 1 req/s per replica
        (300.0, 6),  # + 600 in 300 s: 2 req/s more than arrivals
    ],
)
def test_a_backlog_asks_for_what_drains_it_in_drain_time(drain_time: float | None, desired: int) -> None:
    cfg = replace(RATE, drain_time=drain_time)
    assert decide(cfg, backlog(600, 4.0), 2, PolicyState(), now=120).desired == desired


def test_the_drain_cap_never_goes_below_the_arrival_rate_or_applies_without_one() -> None:
    # No backlog: arrivals (12/s) still ask for 12 even though concurrency asks for 1.
    cfg = replace(RATE, drain_time=60.0)
    assert decide(cfg, arriving(10, 12.0, 120), 1, PolicyState(), now=120).desired == 12
    # Without a target rate there is nothing to cap concurrency by.
    cfg = replace(CFG, drain_time=60.0)
    assert decide(cfg, backlog(600, 4.0), 2, PolicyState(), now=120).desired == 20


def test_the_drain_cap_also_bounds_a_panic() -> None:
    # Arrivals jump to 10/s and 600 wait on 2 replicas: concurrency (610 over target 10) asks
    # for 61; arrivals plus draining the 600 in 60 s ask for 10 + 10 = 20 req/s.
    samples = arriving(10, 1.0, 114) + [replace(s, waiting=600) for s in arriving(10, 10.0, 120, start=114)]
    cfg = replace(RATE, drain_time=60.0, max_replicas=100)
    d = decide(cfg, samples, 2, PolicyState(), now=120)
    assert d.panic
    assert d.desired == 20
    assert decide(replace(cfg, drain_time=None), samples, 2, PolicyState(), now=120).desired == 61


# --- seasonal forecast ----------------------------------------------------------------------


def bursty(until: float, period: float = 600, at: float = 300, length: float = 60) -> list[Sample]:
    """Every 2 s: 1 req/s, and 10 req/s for `length` s at `at` in every `period` (no noise)."""
    out = []
    for i in range(1, int(until / 2) + 1):
        t = 2.0 * i
        rate = 10.0 if at < t % period <= at + length else 1.0
        out.append(Sample(ts=t, running=round(rate), waiting=0, arrival_rate=rate))
    return out


def noisy_bursts(n: int, period: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.poisson(10, n) / 10
    x[np.arange(n) % period < 6] += 9
    return x


def test_find_period_finds_a_noisy_burst_period() -> None:
    lag, corr = find_period(noisy_bursts(300, 60, np.random.default_rng(1)), 2, 1000)
    assert lag == 60
    assert corr > 0.9


def test_find_period_prefers_the_period_to_its_multiples() -> None:
    # 600 buckets cover 60, 120, 180... at least twice each; all correlate about as well.
    assert find_period(noisy_bursts(600, 60, np.random.default_rng(2)), 2, 1000)[0] == 60


def test_find_period_needs_the_period_covered_twice() -> None:
    x = noisy_bursts(110, 60, np.random.default_rng(3))  # 1.8 periods
    lag, _ = find_period(x, 2, 1000)
    assert lag != 60


@pytest.mark.parametrize(
    "x",
    [
        np.ones(300),  # flat
        np.linspace(1, 50, 300),  # a trend is not a season
        np.sin(np.arange(300) * 2 * np.pi / 1000),  # a correlation still falling: no peak in range
    ],
    ids=["flat", "trend", "slow"],
)
def test_find_period_finds_nothing_where_there_is_no_period(x: np.ndarray) -> None:
    lag, corr = find_period(x, 2, 100)
    assert lag == 0 or corr < 0.8


def test_poisson_noise_is_not_trusted_as_a_season() -> None:
    cfg = replace(RATE, forecast=True)
    rng = np.random.default_rng(4)
    for n in (30, 60, 120, 600):
        samples = [
            Sample(ts=10.0 * (i + 1), running=1, waiting=0, arrival_rate=rng.poisson(10) / 10)
            for i in range(n)
        ]
        assert seasonal_forecast(cfg, samples, now=10.0 * n) is None


def test_a_gap_in_scraping_repeats_the_last_rate() -> None:
    samples = [Sample(ts=t, running=0, waiting=0, arrival_rate=r) for t, r in [(0, 2.0), (5, 4.0), (40, 1.0)]]
    x, start = _rate_series(samples, now=40, bucket=10)
    assert start == 0
    assert x.tolist() == [3.0, 3.0, 3.0, 3.0, 1.0]


FORECAST = replace(RATE, forecast=True, forecast_lead=45.0)


def test_the_forecast_starts_replicas_a_lead_before_a_recurring_burst() -> None:
    # Three periods seen; the fourth burst starts at 2100, 40 s from now.
    d = decide(FORECAST, bursty(2060), 2, PolicyState(), now=2060)
    assert d.season is not None
    assert d.season.period == 600
    assert d.season.rate == 10.0
    assert d.desired == 10
    assert d.reason.startswith("forecast")
    assert not d.panic


def test_without_the_forecast_nothing_is_started_before_the_burst() -> None:
    d = decide(RATE, bursty(2060), 2, PolicyState(), now=2060)
    assert d.season is None
    assert d.desired == 1


def test_the_forecast_needs_a_target_rate() -> None:
    cfg = replace(FORECAST, target_rate=None)
    assert decide(cfg, bursty(2060), 2, PolicyState(), now=2060).season is None


@pytest.mark.parametrize(("now", "rate"), [(2040, 1.0), (2060, 10.0), (2150, 10.0), (2170, 1.0)])
def test_the_forecast_covers_the_lead_and_the_burst_then_lets_go(now: float, rate: float) -> None:
    # The rate one period before [now, now + 45 s], whose burst was at 1500-1560 s.
    season = seasonal_forecast(FORECAST, bursty(2060), now)
    assert season is not None
    assert season.rate == rate


def test_the_period_is_not_trusted_before_it_recurs() -> None:
    # 1190 s of history: two bursts seen, but a 600 s period is not covered twice yet.
    assert decide(FORECAST, bursty(1190), 2, PolicyState(), now=1190).season is None


def test_the_forecast_only_adds() -> None:
    # Concurrency asks for 15; the forecast of 10 req/s does not hold it back.
    samples = [replace(s, running=150) if s.ts > 1940 else s for s in bursty(2060)]
    assert decide(FORECAST, samples, 2, PolicyState(), now=2060).desired == 15


def test_forecast_is_pure() -> None:
    samples = bursty(2060)
    before = list(samples)
    first = decide(FORECAST, samples, 2, PolicyState(), now=2060)
    assert decide(FORECAST, samples, 2, PolicyState(), now=2060) == first
    assert samples == before
