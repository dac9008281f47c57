"""The rollout state machine (kvmesh.ops.rollout.schedule): steps, hold, rollback, promotion, standby expiry."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.rollout.canary import Verdict
from kvmesh.ops.rollout.schedule import DEFAULT_STANDBY_S, Action, Phase, RolloutPlan, abort, parse_steps, start, step

PASS = Verdict(True, (), (), 1.0)
FAIL = Verdict(False, ("latency",), ("latency: probe median latency +40.0 % >= 15 %",))
PLAN = RolloutPlan(hold_s=10.0, standby_s=100.0)


def test_defaults_are_the_seed_s() -> None:
    p = RolloutPlan()
    assert p.steps_pct == (5.0, 10.0, 50.0, 100.0) and p.standby_s == DEFAULT_STANDBY_S == 172800.0


def test_start_sets_the_first_step() -> None:
    r = start("v2", "v1", PLAN, 0.0)
    assert r.phase is Phase.RUNNING and r.weights() == {"v2": 0.05, "v1": 0.95} and r.new_share == 0.05
    assert r.events[0].kind == "started"


def test_passing_checks_advance_after_the_hold_to_100_then_standby_expires() -> None:
    r, t = start("v2", "v1", PLAN, 0.0), 0.0
    shares = []
    for _ in range(3):
        r, a = step(r, PASS, t + 5.0)  # within the hold: held
        assert a is Action.NONE
        t += 10.0
        r, a = step(r, PASS, t)
        assert a is Action.SET_WEIGHTS
        shares.append(r.new_share)
    assert shares == [0.10, 0.50, 1.0]
    assert r.phase is Phase.PROMOTED and r.weights() == {"v2": 1.0, "v1": 0.0}  # v1 on standby, weight 0
    assert r.standby_until == t + 100.0 and r.events[-1].kind == "promoted"
    r, a = step(r, None, t + 99.0)
    assert a is Action.NONE and r.phase is Phase.PROMOTED
    r, a = step(r, None, t + 100.0)
    assert a is Action.STANDBY_EXPIRED and r.phase is Phase.COMPLETE and r.events[-1].kind == "standby_expired"
    assert step(r, PASS, t + 200.0)[1] is Action.NONE


def test_a_failed_check_rolls_back_with_the_reason() -> None:
    r = start("v2", "v1", PLAN, 0.0)
    r, a = step(r, FAIL, 1.0)
    assert a is Action.ROLLBACK and r.phase is Phase.ROLLED_BACK and r.new_share == 0.0
    assert r.max_new_share == 0.05 and "latency" in r.events[-1].message and "+40.0 %" in r.events[-1].message
    assert step(r, PASS, 50.0)[1] is Action.NONE  # over


def test_a_failure_at_a_later_step_rolls_back_from_there() -> None:
    r = start("v2", "v1", PLAN, 0.0)
    r, _ = step(r, PASS, 10.0)
    r, a = step(r, FAIL, 11.0)
    assert a is Action.ROLLBACK and r.max_new_share == 0.10 and "at 10 %" in r.events[-1].message


def test_abort_fails_safe_only_while_running() -> None:
    r = abort(start("v2", "v1", PLAN, 0.0), "controller error", 3.0)
    assert r.phase is Phase.ROLLED_BACK and r.new_share == 0.0 and "aborted: controller error" in r.events[-1].message
    promoted, _ = step(start("v2", "v1", RolloutPlan(steps_pct=(50.0, 100.0), hold_s=0.0), 0.0), PASS, 1.0)
    assert promoted.phase is Phase.PROMOTED and abort(promoted, "x", 2.0) is promoted


def test_no_measurement_changes_nothing() -> None:
    r = start("v2", "v1", PLAN, 0.0)
    assert step(r, None, 100.0) == (r, Action.NONE)


def test_versions_and_plan_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="new_version"):
        start("v1", "v1", PLAN, 0.0)
    with pytest.raises(InvalidArgument, match="old_version"):
        start("v2", "", PLAN, 0.0)
    with pytest.raises(InvalidArgument, match="rollout_steps"):
        parse_steps("5,50,10,100")
    with pytest.raises(InvalidArgument, match="rollout_steps"):
        parse_steps("5,x")
    with pytest.raises(InvalidArgument, match="step below 100"):
        parse_steps("100")
    with pytest.raises(InvalidArgument, match="rollout_hold_s"):
        RolloutPlan(hold_s=-1).validated()
    assert parse_steps("25, 100") == (25.0, 100.0)
