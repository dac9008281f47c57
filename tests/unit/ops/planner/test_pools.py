"""Prefill/decode pool sizing and role changes (kvmesh.ops.planner.pools), and a disaggregated zone's step."""

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
from kvmesh.ops.planner.sizing import SizingPolicy, WorkerLife
from kvmesh.ops.planner.zone import PlannerConfig, ZonePlanner

P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
# 1000 prompt tokens and 200 output tokens a request; a prefill worker computes 5000 tokens/s within the TTFT
# target, a decode worker holds 20 streams within the ITL target of 50 ms
POLICY = PoolPolicy(
    prompt_tokens_per_request=1000,
    output_tokens_per_request=200,
    prefill_tokens_per_s=5000,
    decode_streams=20,
    itl_s=0.05,
    buffer=0.2,
    split_delay_s=300,
)


def _pool(*roles: WorkerRole) -> list[PooledWorker]:
    return [PooledWorker(WorkerLife(f"w{i}", float(i)), r) for i, r in enumerate(roles)]


def test_each_pool_is_sized_by_its_own_latency_target() -> None:
    t = pool_targets(POLICY, 12.0)
    # prefill: 12 rps · 1000 tokens = 12000 tokens/s · 1.2 / 5000 = 2.88 → 3
    # decode: 12 rps · 200 tokens · 0.05 s = 120 streams · 1.2 / 20 = 7.2 → 8
    assert (t.prefill_tokens_per_s, t.decode_streams) == pytest.approx((12000.0, 120.0))
    assert (t.prefill, t.decode, t.total) == (3, 8, 11)
    # long prompts, short answers: the split moves to prefill
    long_prompts = pool_targets(PoolPolicy(prompt_tokens_per_request=8000, output_tokens_per_request=20), 2.0)
    assert long_prompts.prefill > long_prompts.decode


def test_the_pools_keep_their_minimum_and_the_zones_bounds() -> None:
    assert pool_targets(POLICY, 0.0) == PoolTargets(1, 1, 0.0, 0.0)
    assert pool_targets(POLICY, 0.0, min_workers=4) == PoolTargets(1, 3, 0.0, 0.0)  # the decode pool takes the rest
    capped = pool_targets(POLICY, 120.0, max_workers=11)  # needs 29P/72D: both shrink in proportion
    assert (capped.prefill, capped.decode) == (3, 8)
    tiny = pool_targets(POLICY, 1000.0, max_workers=2)
    assert (tiny.prefill, tiny.decode) == (1, 1)  # never below either minimum


def test_invalid_pool_policies_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^decode_streams must be > 0"):
        PoolPolicy(decode_streams=0)
    with pytest.raises(ValueError, match=r"^min_decode must be >= 1"):
        PoolPolicy(min_decode=0)


def test_a_short_pool_takes_a_worker_of_the_other_after_the_delay_youngest_first() -> None:
    state = SplitState()
    targets = PoolTargets(prefill=2, decode=2, prefill_tokens_per_s=0, decode_streams=0)
    serving = _pool(P, D, D, D)
    first = plan_split(POLICY, state, 0.0, targets, serving)
    assert (first.prefill, first.decode, first.changes) == (1, 3, ())
    assert first.reason.endswith("role change delay") and first.reason.startswith("prefill pool short by 1")
    assert plan_split(POLICY, state, 299.0, targets, serving).changes == ()
    moved = plan_split(POLICY, state, 300.0, targets, serving)
    assert moved.changes == (RoleChange("w3", D, P),)  # the youngest decode worker
    # one step per delay: the next shortfall waits
    again = plan_split(POLICY, state, 400.0, targets, _pool(P, D, D, D))
    assert again.changes == () and again.reason.endswith("cooldown")


def test_pools_that_match_or_both_lack_change_no_role() -> None:
    state = SplitState()
    matched = plan_split(POLICY, state, 0.0, PoolTargets(1, 3, 0, 0), _pool(P, D, D, D))
    assert (matched.changes, matched.reason, state.short) == ((), "", None)
    both_short = plan_split(POLICY, state, 10_000.0, PoolTargets(3, 5, 0, 0), _pool(P, D))
    assert both_short.changes == () and both_short.reason == ""  # that is a scale-out, not a role change


def test_a_forecast_that_flips_restarts_the_delay() -> None:
    state = SplitState()
    plan_split(POLICY, state, 0.0, PoolTargets(2, 2, 0, 0), _pool(P, D, D, D))  # prefill short
    plan_split(POLICY, state, 200.0, PoolTargets(0, 4, 0, 0), _pool(P, P, D, D))  # now decode short
    assert plan_split(POLICY, state, 350.0, PoolTargets(0, 4, 0, 0), _pool(P, P, D, D)).changes == ()
    assert plan_split(POLICY, state, 500.0, PoolTargets(0, 4, 0, 0), _pool(P, P, D, D)).changes == (
        RoleChange("w1", P, D),
    )


def test_workers_of_role_both_decode_and_keep_their_role() -> None:
    plan = plan_split(POLICY, SplitState(since_s=0.0, short=P), 1000.0, PoolTargets(2, 1, 0, 0), _pool(P, B, B))
    assert (plan.prefill, plan.decode, plan.changes) == (1, 2, ())
    assert plan.reason.endswith("no worker of the other role to change")


def test_a_disaggregated_zone_is_sized_by_its_pools_and_changes_roles() -> None:
    sizing = SizingPolicy(per_worker_rps=1.0, min_workers=2, max_workers=20, scale_in_delay_s=1e9)
    pools = PoolPolicy(
        prompt_tokens_per_request=1000, output_tokens_per_request=10, prefill_tokens_per_s=1000, split_delay_s=0
    )
    zp = ZonePlanner.create(PlannerConfig(sizing, bucket_s=10.0, average_window_s=30.0, pools=pools))
    total = 0.0
    for t in range(0, 100, 10):
        total += 20.0  # 2 req/s: 2000 prompt tokens/s · 1.2 / 1000 → 3 prefill; 2 streams → 1 decode
        zp.history.observe(float(t), {"w": total})
    serving = [WorkerLife(f"10.0.0.{i}:1", float(i)) for i in range(4)]
    roles = {"10.0.0.0:1": P, "10.0.0.1:1": D, "10.0.0.2:1": D, "10.0.0.3:1": D}
    d = zp.step(100.0, serving, starting=0, queued=0, roles=roles)
    assert d.pools is not None and (d.pools.targets.prefill, d.pools.targets.decode) == (3, 1)
    assert d.desired == 4 and d.action.add == 0  # the pools' sum: no scaling, the split moves instead
    assert [(c.worker_id, c.to_role) for c in d.pools.changes] == [("10.0.0.3:1", P)]
    # without pools the same zone is sized by requests alone, with no pool plan
    plain = ZonePlanner.create(PlannerConfig(sizing, bucket_s=10.0, average_window_s=30.0))
    plain.history = zp.history
    assert plain.step(100.0, serving, 0, 0).pools is None
