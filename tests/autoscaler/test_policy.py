"""The scaling policy, one rule at a time: each case is a series of samples and an answer."""

from __future__ import annotations

import pytest

from autoscaler.policy import Decision, PolicyConfig, PolicyState, Sample, decide

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
