"""Arrival rates from the cumulative counters in heartbeats (workers starting, restarting,
joining and leaving), and the history the policy's forecast learns from."""

from __future__ import annotations

import pytest

from autoscaler.load import ArrivalRates, History
from autoscaler.policy import PolicyConfig, Sample
from tokenmill.protocol import Heartbeat, WorkerAnnounce, WorkerDeparture


def announce(worker: str, ts: float) -> WorkerAnnounce:
    return WorkerAnnounce(worker, "dep", f"http://{worker}", "m", ts=ts)


def beat(worker: str, ts: float, arrived: int) -> Heartbeat:
    return Heartbeat(worker, "dep", f"http://{worker}", "m", ts=ts, arrived=arrived, finished=arrived)


def test_a_started_worker_counts_from_its_announcement() -> None:
    rates = ArrivalRates()
    rates.observe(announce("w1", 100.0))
    assert rates.take(["w1"]) is None  # nothing reported yet
    rates.observe(beat("w1", 101.0, 3))  # its first second's requests count
    assert rates.take(["w1"]) == 3.0
    rates.observe(beat("w1", 102.0, 5))
    rates.observe(beat("w1", 104.0, 11))
    assert rates.take(["w1"]) == pytest.approx(8 / 3)  # every report since the last take
    assert rates.take(["w1"]) == pytest.approx(8 / 3)  # nothing new: the rate holds


def test_a_worker_first_heard_mid_life_gives_a_baseline_not_a_rate() -> None:
    rates = ArrivalRates()
    rates.observe(beat("w1", 500.0, 40_000))  # counted over hours, before we listened
    assert rates.take(["w1"]) is None
    rates.observe(beat("w1", 502.0, 40_010))
    assert rates.take(["w1"]) == 5.0


def test_a_counter_that_drops_is_a_restart_counted_from_zero() -> None:
    rates = ArrivalRates()
    rates.observe(beat("w1", 10.0, 500))
    rates.take(["w1"])
    rates.observe(beat("w1", 11.0, 504))
    rates.observe(beat("w1", 13.0, 6))  # restarted without our hearing its announcement
    assert rates.take(["w1"]) == pytest.approx((4 + 6) / 3)


def test_duplicates_and_reports_overtaken_teach_nothing() -> None:
    rates = ArrivalRates()
    rates.observe(announce("w1", 10.0))
    rates.observe(beat("w1", 12.0, 4))
    rates.observe(beat("w1", 12.0, 4))  # the same report twice
    rates.observe(beat("w1", 11.0, 2))  # an older one, late
    assert rates.take(["w1"]) == 2.0


def test_workers_joining_and_leaving_add_and_remove_their_rates() -> None:
    rates = ArrivalRates()
    for w in ("w1", "w2"):
        rates.observe(announce(w, 10.0))
    rates.observe(beat("w1", 11.0, 2))
    rates.observe(beat("w2", 11.0, 3))
    assert rates.take(["w1", "w2"]) == 5.0
    rates.observe(announce("w3", 11.5))  # a new replica comes up
    rates.observe(beat("w3", 12.0, 1))
    rates.observe(beat("w1", 12.0, 4))
    rates.observe(beat("w2", 12.0, 6))
    assert rates.take(["w1", "w2", "w3"]) == 2 + 3 + 2
    rates.observe(WorkerDeparture("w2", "dep"))  # said goodbye
    rates.retain({"w3"})  # and w1 went silent: dropped from the fleet
    assert rates.take(["w1", "w2", "w3"]) == 2
    rates.observe(announce("w1", 13.0))  # back under the same id, counting from zero
    rates.observe(beat("w1", 14.0, 7))
    assert rates.take(["w1", "w3"]) == 7 + 2


def test_history_keeps_the_stable_window_and_folds_older_rates_for_the_forecast() -> None:
    plain = PolicyConfig(stable_window=10)
    forecast = PolicyConfig(stable_window=10, target_rate=1.0, forecast=True, season_bucket=5, season_max=20)
    for config in (plain, forecast):
        history = History()
        for t in range(60):  # a sample a second at rate t
            history.add(Sample(float(t), 1, 0, arrival_rate=float(t)), config)
        samples = history.samples()
        recent = [s for s in samples if s.running]
        assert [s.ts for s in recent] == [float(t) for t in range(50, 60)]
        past = [s for s in samples if not s.running]
        if not config.forecast:
            assert past == [] and len(history) == 10
            continue
        # 5-s buckets of the rates that left the window, over twice the longest period (40 s).
        assert [s.ts for s in past] == [20.0, 25.0, 30.0, 35.0, 40.0, 45.0]
        assert [s.arrival_rate for s in past] == [22.0, 27.0, 32.0, 37.0, 42.0, 47.0]
        assert [s.ts for s in samples] == sorted(s.ts for s in samples)
