"""The sizing policy's edges (kvmesh.ops.planner.sizing): each bound of the policy and its message, the reasons a
step gives, and a scale-in with no worker old enough."""

from __future__ import annotations

import math

import pytest

from kvmesh.ops.planner.sizing import ScaleAction, ScalerState, SizingPolicy, WorkerLife, plan_step

POLICY = SizingPolicy(per_worker_rps=1.0, buffer=0.2, min_workers=2, max_workers=10)


def test_one_warm_worker_is_a_valid_minimum_none_is_not() -> None:
    assert SizingPolicy(per_worker_rps=1.0, min_workers=1).min_workers == 1
    assert SizingPolicy(per_worker_rps=1.0, min_workers=3, max_workers=3).max_workers == 3
    with pytest.raises(ValueError, match=r"^need 1 <= min_workers <= max_workers$"):
        SizingPolicy(per_worker_rps=1.0, min_workers=0)


def test_a_negative_buffer_or_a_zero_scale_in_step_is_refused_alone() -> None:
    message = r"^buffer must be >= 0 and scale_in_step >= 1$"
    with pytest.raises(ValueError, match=message):
        SizingPolicy(per_worker_rps=1.0, buffer=-0.1)
    with pytest.raises(ValueError, match=message):
        SizingPolicy(per_worker_rps=1.0, scale_in_step=0)
    assert SizingPolicy(per_worker_rps=1.0, buffer=0.0, scale_in_step=1).buffer == 0.0


def test_a_forecast_scale_out_says_what_it_needs_and_has() -> None:
    act = plan_step(POLICY, ScalerState(), 0.0, 6, [WorkerLife("a", 0.0)], starting=1, queued=0)
    assert (act.add, act.remove, act.reason) == (4, (), "forecast needs 6, have 2")


def test_no_scale_in_while_no_worker_has_lived_its_minimum_lifetime() -> None:
    st = ScalerState(below_since_s=0.0)
    young = [WorkerLife(f"w{i}", 5000.0 + i) for i in range(5)]  # 1000 s old at most, 1800 s needed
    act = plan_step(POLICY, st, 6000.0, 2, young, 0, 0)
    assert (act.add, act.remove, act.reason) == (0, (), "minimum lifetime")
    assert st.last_scale_in_s == -math.inf  # no scale-in happened, so no cooldown starts
    # one old enough: it goes, and the cooldown starts
    act = plan_step(POLICY, st, 6000.0, 2, [*young, WorkerLife("old", 0.0)], 0, 0)
    assert act.remove == ("old",) and st.last_scale_in_s == 6000.0


def test_each_policy_error_names_its_field_exactly() -> None:
    with pytest.raises(ValueError, match=r"^per_worker_rps must be > 0$"):
        SizingPolicy(per_worker_rps=-1.0)
    with pytest.raises(ValueError, match=r"^lead_s must be > 0$"):
        SizingPolicy(per_worker_rps=1.0, lead_s=-5.0)


def test_a_rate_below_one_request_per_second_is_sized_as_it_is() -> None:
    slow = SizingPolicy(per_worker_rps=0.1, min_workers=1, max_workers=100)
    assert slow.desired(0.5) == 6  # ceil(0.5 · 1.2 / 0.1), not rounded up to 1 rps
    assert slow.desired(-3.0) == 1  # a negative forecast is no load: the minimum


def test_each_waiting_step_says_why() -> None:
    st = ScalerState()
    lives = [WorkerLife(f"w{i}", -10_000.0 + i) for i in range(6)]
    assert plan_step(POLICY, st, 0.0, 2, lives, 0, 0) == ScaleAction(reason="scale-in delay")
    first = plan_step(POLICY, st, 900.0, 2, lives, 0, 0)
    assert first == ScaleAction(remove=("w5",), reason="forecast needs 2, have 6")
    assert plan_step(POLICY, st, 1000.0, 2, lives[:5], 0, 0) == ScaleAction(reason="scale-in cooldown")
    # a worker still starting holds the scale-in back too, whatever the cooldown
    assert plan_step(POLICY, st, 5000.0, 2, lives[:5], 1, 0) == ScaleAction(reason="scale-in cooldown")


def test_a_queue_burst_restarts_the_scale_in_delay() -> None:
    st = ScalerState(below_since_s=0.0)
    lives = [WorkerLife(f"w{i}", -10_000.0 + i) for i in range(4)]
    burst = plan_step(POLICY, st, 1000.0, 2, lives, 0, queued=51)
    assert (burst.add, burst.reason) == (1, "queue 51 > 50")
    assert plan_step(POLICY, st, 1100.0, 2, lives, 0, 0).reason == "scale-in delay"  # the delay starts at 1100
    assert plan_step(POLICY, st, 1999.0, 2, lives, 0, 0).reason == "scale-in delay"
    assert plan_step(POLICY, st, 2000.0, 2, lives, 0, 0).remove == ("w3",)


def test_a_long_queue_adds_nothing_once_the_zone_is_at_its_maximum() -> None:
    full = [WorkerLife(f"w{i}", 0.0) for i in range(10)]
    assert plan_step(POLICY, ScalerState(), 0.0, 10, full, starting=0, queued=500) == ScaleAction()
    act = plan_step(POLICY, ScalerState(), 0.0, 9, full[:8], starting=1, queued=500)  # 9 of 10: one more
    assert (act.add, act.reason) == (1, "queue 500 > 50")


def test_a_zone_at_its_desired_count_does_nothing_and_restarts_the_scale_in_delay() -> None:
    st = ScalerState(below_since_s=0.0)
    lives = [WorkerLife(f"w{i}", -10_000.0 + i) for i in range(4)]
    assert plan_step(POLICY, st, 1000.0, 4, lives, 0, 0) == ScaleAction()
    assert plan_step(POLICY, st, 1100.0, 2, lives, 0, 0).reason == "scale-in delay"  # the delay starts at 1100
    assert plan_step(POLICY, st, 2000.0, 2, lives, 0, 0).remove == ("w3",)


def test_a_forecast_rise_restarts_the_scale_in_delay() -> None:
    st = ScalerState(below_since_s=0.0)
    lives = [WorkerLife(f"w{i}", -10_000.0 + i) for i in range(4)]
    assert plan_step(POLICY, st, 1000.0, 5, lives, 0, 0).add == 1
    assert plan_step(POLICY, st, 1100.0, 2, lives, 0, 0).reason == "scale-in delay"
    assert plan_step(POLICY, st, 2000.0, 2, lives, 0, 0).remove == ("w3",)


def test_a_worker_exactly_at_its_minimum_lifetime_may_be_scaled_in() -> None:
    lives = [WorkerLife("old", 0.0), WorkerLife("w1", 1.0), WorkerLife("exact", 1000.0)]
    assert plan_step(POLICY, ScalerState(below_since_s=0.0), 2800.0, 2, lives, 0, 0).remove == ("exact",)
    assert plan_step(POLICY, ScalerState(below_since_s=0.0), 2799.9, 2, lives, 0, 0).remove == ("w1",)


def test_the_bucket_just_past_the_lead_time_is_not_sized_for() -> None:
    # lead 1200 s of 300-s buckets is exactly 4 buckets: the fifth starts at the lead time, past it
    assert POLICY.sized_rate([300.0, 300.0, 300.0, 300.0, 9000.0], 300.0) == 1.0
