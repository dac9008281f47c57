"""A slow worker leaves rotation (breaker opens), is probed while still slow (re-opens with back-off),
and is readmitted through half-open probes once it is fast again — driven through the default profile."""

import collections

import pytest

from kvmesh.routing import BreakerConfig, CircuitBreaker, CircuitState, Profile, RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_slow_worker_is_avoided_then_readmitted() -> None:
    cfg = BreakerConfig(min_samples=20, cooldown_s=5.0, max_cooldown_s=40.0, probe_successes=2)
    views = [WorkerView(f"w{i}") for i in range(4)]
    breakers = {v.id: CircuitBreaker(cfg) for v in views}
    profile = Profile.default(seed=5)
    recovered_at = 20.0  # w2 answers in 2000 ms until t = 20 s, then in 80 ms
    timeline: list[tuple[float, str, CircuitState]] = []
    for i in range(1200):  # 60 s at 20 requests/s
        now = i * 0.05
        for v in views:
            v.circuit = breakers[v.id].view_state(now)
        d = profile.decide(RoutingQuery(f"r{i}", 200), views)
        assert d.worker_id is not None
        b = breakers[d.worker_id]
        b.on_dispatch(now)
        slow = d.worker_id == "w2" and now < recovered_at
        b.record(now, 2000.0 if slow else 80.0, True)
        timeline.append((now, d.worker_id, breakers["w2"].current(now)))

    to_w2 = [t for t, w, _ in timeline if w == "w2"]
    first_open = next(t for t, _, s in timeline if s is CircuitState.OPEN)
    assert first_open < 10.0  # tripped after ~20 slow samples
    # while slow, w2 receives only its probes after the trip: at most a handful of requests
    assert len([t for t in to_w2 if first_open < t < recovered_at]) <= 3
    # readmitted after recovery: closed again and back to a fair share of the last 10 s
    assert breakers["w2"].current(60.0) is CircuitState.CLOSED
    last = collections.Counter(w for t, w, _ in timeline if t >= 50.0)
    assert last["w2"] > 0.15 * sum(last.values())
    assert breakers["w2"].trips >= 2  # the probe during the slow phase re-opened it (back-off)
