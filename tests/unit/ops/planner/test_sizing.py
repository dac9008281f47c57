"""The planner's sizing formula and scaling steps (kvmesh.ops.planner.sizing)."""

from __future__ import annotations

import pytest

from kvmesh.ops.planner.sizing import ScalerState, SizingPolicy, WorkerLife, plan_step

POLICY = SizingPolicy(per_worker_rps=1.0, buffer=0.2, min_workers=2, max_workers=10)


def _lives(n: int, started: float = 0.0) -> list[WorkerLife]:
    return [WorkerLife(f"w{i}", started + i) for i in range(n)]


def test_desired_adds_the_buffer_and_stays_within_bounds() -> None:
    assert POLICY.desired(5.0) == 6  # 5 rps · 1.2 / 1 rps per worker
    assert POLICY.desired(4.9) == 6  # ceil(5.88)
    assert POLICY.desired(0.0) == 2  # never below the warm minimum
    assert POLICY.desired(100.0) == 10


def test_invalid_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="per_worker_rps"):
        SizingPolicy(per_worker_rps=0.0)
    with pytest.raises(ValueError, match="min_workers"):
        SizingPolicy(per_worker_rps=1.0, min_workers=3, max_workers=2)


def test_scale_out_is_immediate_and_counts_starting_workers() -> None:
    st = ScalerState()
    assert plan_step(POLICY, st, 0.0, 6, _lives(2), starting=0, queued=0).add == 4
    assert plan_step(POLICY, st, 60.0, 6, _lives(2), starting=4, queued=0).add == 0


def test_a_long_queue_adds_a_worker_even_when_the_forecast_does_not() -> None:
    act = plan_step(POLICY, ScalerState(), 0.0, 3, _lives(3), starting=0, queued=51)
    assert act.add == 1 and "queue 51" in act.reason
    assert plan_step(POLICY, ScalerState(), 0.0, 3, _lives(3), starting=0, queued=50).add == 0


def test_scale_in_waits_for_the_delay_then_one_step_per_cooldown() -> None:
    st = ScalerState()
    lives = _lives(6, started=-10_000.0)
    assert plan_step(POLICY, st, 0.0, 2, lives, 0, 0).remove == ()
    assert plan_step(POLICY, st, 899.0, 2, lives, 0, 0).remove == ()
    first = plan_step(POLICY, st, 900.0, 2, lives, 0, 0)
    assert len(first.remove) == 1
    assert plan_step(POLICY, st, 1000.0, 2, lives[:5], 0, 0).remove == ()  # cooldown 600 s
    assert len(plan_step(POLICY, st, 1500.0, 2, lives[:5], 0, 0).remove) == 1


def test_scale_in_takes_the_youngest_old_enough_worker_and_never_goes_below_the_minimum() -> None:
    st = ScalerState(below_since_s=0.0)
    lives = [WorkerLife("old", 0.0), WorkerLife("mid", 100.0), WorkerLife("new", 3000.0)]
    act = plan_step(POLICY, st, 3500.0, 2, lives, 0, 0)
    assert act.remove == ("mid",)  # "new" has lived 500 s < 30 min; "old" keeps the warmest cache
    st = ScalerState(below_since_s=0.0)
    assert plan_step(POLICY, st, 9000.0, 1, lives[:2], 0, 0).remove == ()  # min_workers 2


def test_a_rise_in_demand_resets_the_scale_in_delay() -> None:
    st = ScalerState()
    lives = _lives(4, started=-10_000.0)
    plan_step(POLICY, st, 0.0, 2, lives, 0, 0)
    plan_step(POLICY, st, 500.0, 4, lives, 0, 0)
    assert plan_step(POLICY, st, 1000.0, 2, lives, 0, 0).remove == ()  # the delay restarted at 1000


def test_the_fleet_is_sized_for_the_forecast_peak_within_the_lead_time_only() -> None:
    # 5-min buckets, lead 20 min = the first 4: the rise in bucket 6 is left to a later step
    forecast = [300.0, 600.0, 450.0, 300.0, 300.0, 3000.0]
    assert POLICY.sized_rate(forecast, 300.0) == 2.0  # 600 arrivals / 300 s
    assert SizingPolicy(per_worker_rps=1.0, lead_s=1800.0).sized_rate(forecast, 300.0) == 10.0
    assert SizingPolicy(per_worker_rps=1.0, lead_s=1.0).sized_rate(forecast, 300.0) == 1.0  # at least one bucket
    assert POLICY.sized_rate([], 300.0) == 0.0
    with pytest.raises(ValueError, match="lead_s"):
        SizingPolicy(per_worker_rps=1.0, lead_s=0.0)
