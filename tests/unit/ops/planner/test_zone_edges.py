"""A zone's planning step at its edges (kvmesh.ops.planner.zone): when the forecasters are judged and on what,
the LSTM refitted when it wins, a step with no history, the removable workers, a disaggregated zone's figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmesh.core.handoff import WorkerRole
from kvmesh.ops.planner import zone as zone_module
from kvmesh.ops.planner.forecast import (
    Comparison,
    Forecaster,
    LstmForecaster,
    MovingAverage,
    SameTimeYesterday,
    baselines,
    compare,
    mae,
)
from kvmesh.ops.planner.pools import PoolPolicy
from kvmesh.ops.planner.sizing import ScalerState, SizingPolicy, WorkerLife
from kvmesh.ops.planner.zone import PlannerConfig, ZonePlanner

HOUR = 3600.0
DAY = 24  # hourly buckets


def _hourly_planner(buckets: int, start_hour: int = 0, epochs: int = 1) -> ZonePlanner:
    cfg = PlannerConfig(SizingPolicy(per_worker_rps=1.0), bucket_s=HOUR, horizon_buckets=2, lstm_epochs=epochs)
    zp = ZonePlanner.create(cfg)
    hours = np.arange(start_hour, start_hour + buckets)
    zp.history.counts = (1000 + 500 * np.sin(2 * np.pi * hours / DAY)).tolist()
    zp.history.start_s = start_hour * HOUR
    return zp


def test_the_forecasters_are_judged_once_exactly_three_days_are_complete() -> None:
    short = _hourly_planner(3 * DAY - 1)
    assert not short.maybe_retrain((3 * DAY - 1) * HOUR) and short.comparison is None
    exact = _hourly_planner(3 * DAY)
    assert exact.maybe_retrain(3 * DAY * HOUR) and exact.comparison is not None


def test_the_forecasters_are_judged_on_the_last_day_at_the_planners_horizon() -> None:
    zp = _hourly_planner(3 * DAY)
    assert zp.maybe_retrain(3 * DAY * HOUR) and zp.comparison is not None
    series = zp.history.completed(3 * DAY * HOUR)
    held_out = series.size - DAY
    expected = {f.name: mae(f, series, held_out, 2) for f in baselines(DAY, 1)}
    assert zp.comparison.baselines == pytest.approx(expected)


def test_a_winning_lstm_is_refitted_on_the_whole_history_at_its_time_of_day(monkeypatch: pytest.MonkeyPatch) -> None:
    # a stand-in for the judgement (the LSTM wins it), so that the refit that follows is what is tested
    judged: list[tuple[int, int]] = []

    def lstm_wins(series: Any, test_from: int, period: int, hour_buckets: int, lstm: LstmForecaster) -> Comparison:
        judged.append((test_from, period))
        return Comparison(0.0, {"last_value": 1.0}, "lstm")

    monkeypatch.setattr(zone_module, "compare", lstm_wins)
    zp = _hourly_planner(3 * DAY, start_hour=5, epochs=2)
    assert zp.history.start_bucket == 5
    assert zp.maybe_retrain((5 + 3 * DAY) * HOUR)
    assert judged == [(2 * DAY, DAY)]  # judged on the last day
    trusted = zp.forecaster()
    assert isinstance(trusted, LstmForecaster) and trusted.horizon == 2
    series = zp.history.completed((5 + 3 * DAY) * HOUR)
    reference = LstmForecaster(period=DAY, horizon=2, epochs=2)
    reference.fit(series, 5)
    np.testing.assert_allclose(trusted.predict(series, 5, 2), reference.predict(series, 5, 2), rtol=1e-6)
    d = zp.step((5 + 3 * DAY) * HOUR, [WorkerLife("a", 0.0), WorkerLife("b", 0.0)], starting=0, queued=0)
    assert d.forecaster == "lstm"
    np.testing.assert_allclose(d.forecast, reference.predict(series, 5, 2), rtol=1e-6)


def test_a_step_with_no_complete_bucket_forecasts_nothing() -> None:
    zp = ZonePlanner.create(PlannerConfig(SizingPolicy(per_worker_rps=1.0), bucket_s=10.0))
    d = zp.step(0.0, [WorkerLife("a", 0.0), WorkerLife("b", 0.0)], starting=0, queued=0)
    assert (d.forecast, d.forecast_rps, d.desired, d.action.add) == ((), 0.0, 2, 0)


def test_a_zone_scales_in_only_the_workers_its_actuator_can_stop() -> None:
    sizing = SizingPolicy(per_worker_rps=1.0, min_workers=2)
    serving = [WorkerLife(f"w{i}", float(i)) for i in range(4)]
    for removable, removed in ((frozenset(), ()), (frozenset({"w1"}), ("w1",))):
        zp = ZonePlanner.create(PlannerConfig(sizing, bucket_s=10.0))
        zp.state = ScalerState(below_since_s=0.0)  # below the current count long enough
        d = zp.step(10_000.0, serving, starting=0, queued=0, removable=removable)
        assert d.desired == 2 and d.action.remove == removed


def _disaggregated() -> ZonePlanner:
    sizing = SizingPolicy(per_worker_rps=1.0, min_workers=2, max_workers=20, scale_in_delay_s=1e9)
    pools = PoolPolicy(
        prompt_tokens_per_request=1000, output_tokens_per_request=10, prefill_tokens_per_s=1000, split_delay_s=0
    )
    zp = ZonePlanner.create(PlannerConfig(sizing, bucket_s=10.0, average_window_s=30.0, pools=pools))
    total = 0.0
    for t in range(0, 100, 10):
        total += 20.0  # 2 req/s: 3 prefill, 1 decode
        zp.history.observe(float(t), {"w": total})
    return zp


def test_a_disaggregated_step_reports_its_sized_rate() -> None:
    serving = [WorkerLife(f"w{i}", float(i)) for i in range(4)]
    d = _disaggregated().step(100.0, serving, 0, 0, roles={"w0": WorkerRole.PREFILL})
    assert d.forecast_rps == pytest.approx(2.0) and d.forecast == pytest.approx((20.0,) * 12)


def test_a_disaggregated_step_counts_the_workers_changing_role() -> None:
    # w3 is restarting as a prefill worker (not serving): with it the pools are 3P/1D, as targeted
    serving = [WorkerLife(f"w{i}", float(i)) for i in range(3)]
    roles = {"w0": WorkerRole.PREFILL, "w1": WorkerRole.PREFILL, "w2": WorkerRole.DECODE}
    d = _disaggregated().step(100.0, serving, 1, 0, roles=roles, incoming={WorkerRole.PREFILL: 1})
    assert d.pools is not None and (d.pools.prefill, d.pools.decode, d.pools.changes) == (3, 1, ())


def test_an_average_window_shorter_than_a_bucket_averages_the_last_bucket() -> None:
    zp = ZonePlanner.create(PlannerConfig(SizingPolicy(per_worker_rps=1.0), bucket_s=10.0, average_window_s=5.0))
    assert zp.forecaster().predict(np.array([10.0, 30.0]), 0, 2).tolist() == [30.0, 30.0]
    hour = ZonePlanner.create(PlannerConfig(SizingPolicy(per_worker_rps=1.0), bucket_s=10.0, average_window_s=30.0))
    assert hour.forecaster().predict(np.array([1.0, 10.0, 30.0, 50.0]), 0, 1).tolist() == [30.0]  # the last 3


def test_the_forecasters_are_judged_again_exactly_retrain_s_later() -> None:
    zp = _hourly_planner(3 * DAY)
    zp.last_train_s = 3 * DAY * HOUR - zp.config.retrain_s
    assert zp.maybe_retrain(3 * DAY * HOUR)
    zp.last_train_s = 3 * DAY * HOUR - zp.config.retrain_s + 1.0
    assert not zp.maybe_retrain(3 * DAY * HOUR)


def test_the_judged_lstm_has_the_planners_period_horizon_and_epochs() -> None:
    zp = _hourly_planner(3 * DAY, epochs=2)
    assert zp.maybe_retrain(3 * DAY * HOUR) and zp.comparison is not None
    series = zp.history.completed(3 * DAY * HOUR)
    independent = compare(series, series.size - DAY, DAY, 1, LstmForecaster(period=DAY, horizon=2, epochs=2))
    assert zp.comparison.lstm_mae == pytest.approx(independent.lstm_mae)


@pytest.mark.parametrize(
    ("chosen", "expected"), [("moving_average", MovingAverage(1)), ("same_time_yesterday", SameTimeYesterday(DAY))]
)
def test_a_winning_baseline_is_trusted_with_the_zones_periods(
    monkeypatch: pytest.MonkeyPatch, chosen: str, expected: Forecaster
) -> None:
    # a stand-in for the judgement, naming the winner
    monkeypatch.setattr(zone_module, "compare", lambda *a: Comparison(9.0, {chosen: 1.0}, chosen))
    zp = _hourly_planner(3 * DAY)
    assert zp.maybe_retrain(3 * DAY * HOUR)
    assert zp.forecaster() == expected


def test_a_disaggregated_zone_counts_unlisted_workers_as_decode_and_keeps_the_zone_maximum() -> None:
    serving = [WorkerLife(f"w{i}", float(i)) for i in range(4)]
    d = _disaggregated().step(100.0, serving, 0, 0, roles={"w0": WorkerRole.PREFILL})
    assert d.pools is not None and (d.pools.prefill, d.pools.decode) == (1, 3)  # w1..w3 listed nowhere: both
    zp = _disaggregated()
    zp.config = PlannerConfig(
        SizingPolicy(per_worker_rps=1.0, min_workers=2, max_workers=3), bucket_s=10.0, pools=zp.config.pools
    )
    capped = zp.step(100.0, serving[:3], 0, 0)
    assert capped.desired == 3 and capped.pools is not None and capped.pools.targets.total == 3


def test_a_disaggregated_zone_scales_in_only_the_workers_its_actuator_can_stop() -> None:
    idle = ZonePlanner.create(
        PlannerConfig(SizingPolicy(per_worker_rps=1.0, min_workers=2), bucket_s=10.0, pools=PoolPolicy())
    )
    idle.state = ScalerState(below_since_s=0.0)
    serving = [WorkerLife(f"w{i}", float(i)) for i in range(4)]
    assert idle.step(10_000.0, serving, 0, 0, removable=frozenset()).action.remove == ()
    idle.state = ScalerState(below_since_s=0.0)
    assert idle.step(10_000.0, serving, 0, 0, removable=frozenset({"w0"})).action.remove == ("w0",)
