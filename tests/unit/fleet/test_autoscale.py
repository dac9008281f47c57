"""The planner in the fleet simulator: workers join cold after a start-up time, leave drained
(kvmesh.fleet.autoscale), on a short trace with a 10x burst."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.fleet.autoscale import Autoscaler, AutoscaleSettings, plan_open_loop, worker_range
from kvmesh.fleet.autoscale_eval import slo_hours
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.sim import FleetConfig, FleetSim
from kvmesh.fleet.trace import Trace, TraceRequest
from kvmesh.ops.planner.forecast import LastValue
from kvmesh.ops.planner.sizing import SizingPolicy

BASE_RPS, BURST = 0.2, 10


def _burst_trace() -> Trace:
    """10 min at 0.2 req/s, 10 min at 2 req/s, 20 min at 0.2 req/s; 2,048-token prompts, 16 output tokens."""
    rng = np.random.default_rng(0)
    reqs: list[TraceRequest] = []
    t = 0.0
    while t < 2400.0:
        rate = BASE_RPS * (BURST if 600.0 <= t < 1200.0 else 1)
        t += float(rng.exponential(1 / rate))
        i = len(reqs)
        reqs.append(
            TraceRequest(i, t, 2048, 16, (1_000_000 + 4 * i, 1_000_001 + 4 * i, 1_000_002 + 4 * i, 1_000_003 + 4 * i))
        )
    return Trace("burst", reqs)


def _run(trace: Trace) -> tuple[FleetSim, Autoscaler]:
    sizing = SizingPolicy(
        per_worker_rps=0.4, min_workers=2, max_workers=8, min_lifetime_s=300.0, scale_in_delay_s=120.0,
        scale_in_cooldown_s=60.0,
    )  # fmt: skip
    settings = AutoscaleSettings(
        sizing, initial_workers=2, tick_s=30.0, bucket_s=60.0, horizon_buckets=5, startup_s=60.0
    )
    arrivals = np.array([r.arrival_s for r in trace.requests])
    scaler = Autoscaler(settings, LastValue(), history=np.array([]), arrivals_s=arrivals)
    sim = FleetSim(trace, make_policy("kvmesh"), FleetConfig(workers=8))
    scaler.attach(sim)
    sim.run()
    scaler.finish(sim.now)
    return sim, scaler


def test_the_fleet_scales_out_for_a_burst_and_back_in_losing_no_request() -> None:
    trace = _burst_trace()
    sim, scaler = _run(trace)
    serving = [(t, n) for t, n, _, _ in scaler.timeline]
    during = max(n for t, n in serving if 600.0 <= t < 1500.0)
    assert during >= 5  # 2 req/s · 1.2 / 0.4 per worker = 6 desired
    assert min(n for _, n in serving) >= 2  # never below the warm minimum
    assert serving[-1][1] == 2  # back in after the burst
    recs = sim.records
    assert all(r is not None and not math.isnan(r.finish) for r in recs), "every request finished"
    assert sim.rejected == 0
    hours = sim.now / 3600.0
    assert scaler.billed_s / 3600.0 < 8 * hours  # fewer GPU-hours than keeping every slot on
    assert scaler.summary()["max_workers"] >= during


def test_a_worker_that_joins_starts_cold_and_a_busy_one_cannot_be_reset() -> None:
    trace = _burst_trace()
    sim = FleetSim(trace, make_policy("kvmesh"), FleetConfig(workers=2))
    sim.run()
    w = sim.ids[0]
    assert sim.idle(0)
    sim.reset_worker(0)
    assert sim.engines[0].pool.match_prefix(sim.hc.hashes(0).tolist()) == []
    assert sim.index.find_matches(sim.hc.hashes(0)).get(w, 0) == 0
    busy = FleetSim(trace, make_policy("kvmesh"), FleetConfig(workers=2))
    busy._busy[0] = True  # a step in flight
    with pytest.raises(RuntimeError, match="still has work"):
        busy.reset_worker(0)


def test_the_open_loop_replay_follows_the_burst_and_bills_about_what_the_simulated_fleet_does() -> None:
    trace = _burst_trace()
    sim, scaler = _run(trace)
    arrivals = np.array([r.arrival_s for r in trace.requests])
    plan = plan_open_loop(scaler.settings, LastValue(), np.array([]), arrivals, end_s=sim.now)
    serving = [(t, n) for t, n, _, _ in plan.timeline]
    assert max(n for t, n in serving if 600.0 <= t < 1500.0) >= 5
    assert min(n for _, n in serving) >= 2 and serving[-1][1] == 2
    assert plan.serving_at(0.0) == 2 and plan.serving_at(1e9) == 2
    # the same decisions, less the drains' tails and the queue rule
    assert plan.billed_s == pytest.approx(scaler.billed_s, rel=0.15)
    assert worker_range(plan.timeline)["max_workers"] >= 5


def test_slo_windows_are_the_steepest_rise_then_the_peak_then_further_rises() -> None:
    hourly = np.array([1, 2, 8, 9, 10, 4, 6, 2], dtype=float)
    assert slo_hours(hourly, 1) == [2]  # +6 from hour 1
    assert slo_hours(hourly, 2) == [2, 4]  # then the peak
    assert slo_hours(hourly, 4) == [2, 4, 6, 1]  # then +2 at 6, +1 at 1 (ties in hour order: 1 before 3, 4)
    assert slo_hours(np.array([3.0, 1.0]), 2) == [1, 0]  # no rise: the least fall, then the peak
