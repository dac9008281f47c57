"""The planner's load history and its planning step (kvmesh.ops.planner.history, kvmesh.ops.planner.zone)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.planner.history import LoadHistory
from kvmesh.ops.planner.sizing import SizingPolicy, WorkerLife
from kvmesh.ops.planner.zone import PlannerConfig, ZonePlanner
from kvmesh.services.planner.actuators import make_actuator
from kvmesh.services.planner.settings import PlannerSettings, zone_map


def test_history_counts_deltas_per_bucket_and_survives_counter_resets() -> None:
    h = LoadHistory(bucket_s=10.0)
    h.observe(100.0, {"w0": 50.0})  # first sight: its count predates the planner
    h.observe(105.0, {"w0": 54.0, "w1": 7.0})
    h.observe(112.0, {"w0": 60.0, "w1": 9.0})
    h.observe(121.0, {"w0": 3.0, "w1": 10.0})  # w0's router restarted: its 3 count
    assert h.completed(121.0).tolist() == [4.0, 8.0]
    assert h.completed(130.0).tolist() == [4.0, 8.0, 4.0]
    assert h.start_bucket == 10  # 100 s into the day, 10 s buckets


def test_history_round_trips_and_refuses_a_bad_checkpoint() -> None:
    h = LoadHistory(bucket_s=60.0, max_buckets=3)
    for i in range(5):
        h.observe(60.0 * i, {"w": float(10 * i)})
    assert len(h.counts) == 3 and h.start_s == 120.0  # the oldest buckets dropped
    back = LoadHistory.from_json(h.to_json())
    assert back.counts == h.counts and back.last_totals == h.last_totals and back.start_s == h.start_s
    with pytest.raises(ValueError, match="bad or missing field"):
        LoadHistory.from_json({"bucket_s": 60.0})
    with pytest.raises(ValueError, match="bucket_s must be > 0"):
        LoadHistory.from_json({**h.to_json(), "bucket_s": 0})


def test_zone_planner_sizes_from_the_moving_average_until_a_held_out_day_exists() -> None:
    cfg = PlannerConfig(SizingPolicy(per_worker_rps=1.0, max_workers=20), bucket_s=10.0, average_window_s=30.0)
    zp = ZonePlanner.create(cfg)
    total = 0.0
    for t in range(0, 100, 10):
        total += 80.0  # 8 req/s
        zp.history.observe(float(t), {"w": total})
    d = zp.step(100.0, [WorkerLife("w", 0.0)], starting=0, queued=0)
    assert d.forecaster == "moving_average"
    assert d.forecast_rps == pytest.approx(8.0)
    assert d.desired == 10 and d.action.add == 9  # 8 · 1.2 / 1 → 10 workers
    assert not zp.maybe_retrain(100.0)  # no held-out day yet


def test_zone_planner_judges_the_forecasters_once_three_days_are_recorded() -> None:
    cfg = PlannerConfig(SizingPolicy(per_worker_rps=1.0), bucket_s=3600.0, horizon_buckets=2, lstm_epochs=5)
    zp = ZonePlanner.create(cfg)
    hours = np.arange(24 * 3 + 1)
    zp.history.counts = (1000 + 500 * np.sin(2 * np.pi * hours / 24)).tolist()
    zp.history.start_s = 0.0
    assert zp.maybe_retrain(3600.0 * (24 * 3 + 1))
    assert zp.comparison is not None
    assert zp.forecaster().name == zp.comparison.chosen
    assert not zp.maybe_retrain(3600.0 * (24 * 3 + 2))  # not due again before retrain_s


def test_planner_settings_are_checked_naming_the_field() -> None:
    assert zone_map("routers", ("a=h:1", "b=h:2"), "host:port") == {"a": "h:1", "b": "h:2"}
    for bad in ((), ("a",), ("a=h:1", "a=h:2")):
        with pytest.raises(InvalidArgument, match="routers"):
            zone_map("routers", bad, "host:port")
    with pytest.raises(InvalidArgument, match="actuator"):
        make_actuator(PlannerSettings(actuator="cloud"))
    with pytest.raises(InvalidArgument, match="registry_file"):
        make_actuator(PlannerSettings(actuator="local"))
