"""The rollout state machine at its edges: a check exactly `hold_s` after the step started advances it, the
standby ends exactly at `standby_until`; every event is recorded with its time, kind and message; the plan's
validation at each bound, naming the field."""

from __future__ import annotations

import math

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.rollout.canary import Verdict
from kvmesh.ops.rollout.schedule import Action, Event, Phase, RolloutPlan, abort, parse_steps, start, step

pytestmark = pytest.mark.unit
PASS = Verdict(True, (), (), 1.0)
FAIL = Verdict(False, ("latency", "memory"), ("latency: slow", "memory: big"))
PLAN = RolloutPlan(steps_pct=(5.0, 50.0, 100.0), hold_s=10.0, standby_s=100.0)


def test_every_event_has_its_time_kind_and_message() -> None:
    r = start("v2", "v1", PLAN, 1.0)
    r, _ = step(r, PASS, 11.0)  # exactly hold_s after the step started: advances
    r, _ = step(r, PASS, 21.0)
    r, _ = step(r, None, 121.0)  # exactly standby_s after the promotion: the standby is over
    assert r.events == (
        Event(1.0, "started", "v2 replaces v1: step 1/3 at 5 %"),
        Event(11.0, "step", "v2 passed at 5 %: step 2/3 at 50 %"),
        Event(21.0, "promoted", "v2 promoted to 100 %; v1 on standby for 100 s"),
        Event(121.0, "standby_expired", "standby of v1 over: it may be retired"),
    )
    assert r.phase is Phase.COMPLETE and r.verdict == PASS and r.max_new_share == 1.0


def test_a_check_just_inside_the_hold_keeps_the_step_and_records_the_verdict() -> None:
    r = start("v2", "v1", PLAN, 0.0)
    held, action = step(r, PASS, 9.999)
    assert action is Action.NONE and held.step_index == 0 and held.verdict == PASS and held.events == r.events


def test_a_rollback_records_the_verdict_and_every_reason() -> None:
    r, _ = step(start("v2", "v1", PLAN, 0.0), FAIL, 3.0)
    assert r.verdict == FAIL and r.phase is Phase.ROLLED_BACK
    assert r.events[-1] == Event(3.0, "rolled_back", "v2 at 5 % failed latency, memory: latency: slow; memory: big")


def test_abort_records_when_and_why() -> None:
    r = abort(start("v2", "v1", PLAN, 0.0), "controller lost its lease", 4.0)
    assert r.events[-1] == Event(4.0, "rolled_back", "v2 at 5 % aborted: controller lost its lease")
    assert r.new_share == 0.0


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ((), "every step must be in (0, 100], got ()"),
        ((0.0, 100.0), "every step must be in (0, 100], got (0.0, 100.0)"),
        ((5.0, 100.5), "every step must be in (0, 100]"),
        ((5.0, math.nan, 100.0), "every step must be in (0, 100]"),
        ((50.0, 50.0, 100.0), "steps must increase and end at 100, got (50.0, 50.0, 100.0)"),
        ((5.0, 50.0), "steps must increase and end at 100"),
        ((100.0,), "a canary needs a step below 100 before 100, got (100.0,)"),
    ],
)
def test_plan_steps_at_each_bound_are_refused_naming_the_field(steps: tuple[float, ...], message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        RolloutPlan(steps_pct=steps).validated()
    assert e.value.field == "rollout_steps" and message in str(e.value)


def test_the_smallest_valid_plan_and_zero_hold_and_standby() -> None:
    assert RolloutPlan(steps_pct=(0.001, 100.0), hold_s=0.0, standby_s=0.0).validated().steps_pct == (0.001, 100.0)
    with pytest.raises(InvalidArgument) as e:
        RolloutPlan(hold_s=-1.0).validated()
    assert e.value.field == "rollout_hold_s" and "must be a finite number >= 0, got -1.0" in str(e.value)


def test_parse_steps_names_the_field() -> None:
    assert parse_steps("5, 50,100,") == (5.0, 50.0, 100.0)
    with pytest.raises(InvalidArgument) as e:
        parse_steps("5,x,100")
    assert e.value.field == "rollout_steps" and "not a comma list of numbers: '5,x,100'" in str(e.value)


def test_start_names_the_empty_or_equal_version() -> None:
    for new, old, field in (("", "v1", "new_version"), ("v2", "", "old_version")):
        with pytest.raises(InvalidArgument) as e:
            start(new, old, PLAN, 0.0)
        assert e.value.field == field and "must be non-empty" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        start("v1", "v1", PLAN, 0.0)
    assert e.value.field == "new_version" and "must differ from old_version ('v1')" in str(e.value)


def test_no_standby_deadline_before_the_promotion() -> None:
    r, _ = step(start("v2", "v1", PLAN, 0.0), PASS, 10.0)
    assert r.phase is Phase.RUNNING and r.standby_until == 0.0
    r, _ = step(r, PASS, 20.0)
    assert r.phase is Phase.PROMOTED and r.standby_until == 120.0
