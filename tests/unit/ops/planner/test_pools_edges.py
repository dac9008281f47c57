"""The pools' edges (kvmesh.ops.planner.pools): the policy's bounds and messages, the cap's prefill side, a shortfall
of exactly one, a matched pool, and workers changing role counted where they go."""

from __future__ import annotations

import pytest

from kvmesh.core.handoff import WorkerRole
from kvmesh.ops.planner.pools import (
    PooledWorker,
    PoolPolicy,
    PoolTargets,
    RoleChange,
    SplitState,
    plan_split,
    pool_targets,
)
from kvmesh.ops.planner.sizing import WorkerLife

P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
POLICY = PoolPolicy(split_delay_s=300)


def _pool(*roles: WorkerRole) -> list[PooledWorker]:
    return [PooledWorker(WorkerLife(f"w{i}", float(i)), r) for i, r in enumerate(roles)]


def test_a_negative_policy_value_is_refused_with_its_name_and_value() -> None:
    for name in ("prompt_tokens_per_request", "output_tokens_per_request", "buffer", "split_delay_s"):
        with pytest.raises(ValueError, match=rf"^{name} must be >= 0, got -0\.5$"):
            PoolPolicy(**{name: -0.5})  # type: ignore[arg-type]
        assert getattr(PoolPolicy(**{name: 0}), name) == 0  # type: ignore[arg-type]


def test_a_prefill_pool_of_zero_is_allowed_below_zero_refused() -> None:
    assert PoolPolicy(min_prefill=0).min_prefill == 0
    with pytest.raises(ValueError, match=r"^min_prefill must be >= 0, got -1$"):
        PoolPolicy(min_prefill=-1)
    with pytest.raises(ValueError, match=r"^role_change_step must be >= 1, got 0$"):
        PoolPolicy(role_change_step=0)


def test_a_prefill_heavy_zone_capped_keeps_the_decode_minimum() -> None:
    # long prompts, one output token: 138 prefill and 1 decode workers wanted; capped at 2 the prefill share rounds
    # to both, but the decode pool keeps its minimum of 1
    heavy = PoolPolicy(prompt_tokens_per_request=8000, output_tokens_per_request=1)
    assert (pool_targets(heavy, 100.0).prefill, pool_targets(heavy, 100.0).decode) == (138, 1)
    capped = pool_targets(heavy, 100.0, max_workers=2)
    assert (capped.prefill, capped.decode) == (1, 1)


def test_a_pool_short_while_the_other_matches_changes_no_role() -> None:
    state = SplitState()
    plan = plan_split(POLICY, state, 0.0, PoolTargets(2, 2, 0, 0), _pool(P, D, D))  # prefill short, decode exact
    assert (plan.prefill, plan.decode, plan.changes, plan.reason, state.short) == (1, 2, (), "", None)
    plan = plan_split(POLICY, state, 0.0, PoolTargets(1, 3, 0, 0), _pool(P, D))  # decode short, prefill exact
    assert (plan.changes, plan.reason, state.short) == ((), "", None)


def test_a_decode_pool_short_by_exactly_one_takes_a_prefill_worker() -> None:
    state = SplitState(short=D, since_s=0.0)
    plan = plan_split(POLICY, state, 1000.0, PoolTargets(1, 3, 0, 0), _pool(P, P, D, D))
    assert plan.changes == (RoleChange("w1", P, D),)  # the younger prefill worker
    assert (plan.prefill, plan.decode) == (2, 2)  # the pools as they serve now, before the change
    assert plan.reason == "decode pool short by 1 (needs 1P/3D, has 2P/2D)"


def test_workers_changing_role_count_in_the_pool_they_go_to() -> None:
    # one worker is restarting as a decode worker: with it the pools match, so nothing more changes
    state = SplitState()
    plan = plan_split(POLICY, state, 0.0, PoolTargets(2, 2, 0, 0), _pool(P, P, D), {D: 1})
    assert (plan.prefill, plan.decode, plan.changes, plan.reason) == (2, 2, (), "")
    plan = plan_split(POLICY, state, 0.0, PoolTargets(2, 2, 0, 0), _pool(P, D, D), {P: 1})
    assert (plan.prefill, plan.decode, plan.changes, plan.reason) == (2, 2, (), "")


def test_a_plan_in_the_cooldown_still_carries_its_targets() -> None:
    targets = PoolTargets(2, 2, 1.0, 2.0)
    state = SplitState(short=P, since_s=0.0, last_change_s=900.0)
    plan = plan_split(POLICY, state, 1000.0, targets, _pool(P, D, D, D))
    assert plan.reason.endswith("role change cooldown") and plan.targets == targets
    assert (plan.prefill, plan.decode) == (1, 3)


def test_minimums_above_the_zones_maximum_win() -> None:
    # 2 + 2 minimum workers in a zone capped at 3: the pools keep their minimums, the cap gives way
    capped = pool_targets(PoolPolicy(min_prefill=2, min_decode=2), 1000.0, max_workers=3)
    assert (capped.prefill, capped.decode) == (2, 2)


def test_a_pool_exact_while_the_other_holds_more_changes_no_role() -> None:
    state = SplitState()
    for serving in (_pool(P, D, D, D), _pool(P, P, D, D)):  # prefill exact, decode over; then the other way
        plan = plan_split(POLICY, state, 0.0, PoolTargets(1, 2, 0, 0), serving)  # the surplus is a scale-in
        assert (plan.changes, plan.reason, state.short) == ((), "", None)


def test_a_plan_with_no_worker_to_change_still_carries_its_targets() -> None:
    targets = PoolTargets(2, 1, 5.0, 6.0)
    serving = [PooledWorker(WorkerLife("p", 0.0), P), *(PooledWorker(WorkerLife(w, 1.0), B) for w in "bc")]
    plan = plan_split(POLICY, SplitState(short=P, since_s=0.0), 1000.0, targets, serving)
    assert plan.reason.endswith("no worker of the other role to change") and plan.targets == targets


def test_a_role_change_is_allowed_again_exactly_one_delay_after_the_last() -> None:
    state = SplitState(short=P, since_s=0.0, last_change_s=700.0)
    assert plan_split(POLICY, state, 1000.0, PoolTargets(2, 2, 0, 0), _pool(P, D, D, D)).changes == (
        RoleChange("w3", D, P),
    )


def test_a_step_moves_at_most_role_change_step_and_at_most_the_shortfall() -> None:
    wide = PoolPolicy(split_delay_s=0, role_change_step=3)
    one_short = plan_split(wide, SplitState(), 0.0, PoolTargets(2, 3, 0, 0), _pool(P, D, D, D, D))
    assert [c.worker_id for c in one_short.changes] == ["w4"]
    two = PoolPolicy(split_delay_s=0, role_change_step=2)
    three_short = plan_split(two, SplitState(), 0.0, PoolTargets(4, 2, 0, 0), _pool(P, D, D, D, D))
    assert [c.worker_id for c in three_short.changes] == ["w4", "w3"]


def test_with_no_prefill_minimum_an_idle_zone_needs_one_decode_worker() -> None:
    assert pool_targets(PoolPolicy(min_prefill=0), 0.0) == PoolTargets(0, 1, 0.0, 0.0)


def test_a_pool_exactly_at_its_capacity_needs_no_extra_worker() -> None:
    exact = PoolPolicy(
        prompt_tokens_per_request=1000,
        output_tokens_per_request=100,
        prefill_tokens_per_s=1000,
        decode_streams=10,
        itl_s=0.1,
        buffer=0.0,
    )
    t = pool_targets(exact, 3.0)  # 3000 tokens/s on 1000 per worker, 30 streams on 10 per worker
    assert (t.prefill, t.decode) == (3, 3)
