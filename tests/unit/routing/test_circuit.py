"""Circuit breaker: trips on p95 > 1200 ms or errors > 1 % with enough samples; half-open probes; backoff."""

import pytest

from kvmesh.routing.circuit import BreakerConfig, CircuitBreaker, p95
from kvmesh.routing.types import CircuitState

pytestmark = pytest.mark.unit
CFG = BreakerConfig(min_samples=20, window_s=30, cooldown_s=5, max_cooldown_s=20, probe_successes=2)


def test_p95_rank() -> None:
    assert p95(list(range(1, 101))) == 95
    assert p95([]) == 0.0


def test_needs_min_samples_then_trips_on_latency() -> None:
    b = CircuitBreaker(CFG)
    for i in range(19):
        assert b.record(i * 0.1, 5000, True) is CircuitState.CLOSED  # slow, but too few samples
    assert b.record(2.0, 5000, True) is CircuitState.OPEN
    assert "p95" in b.reason


def test_p95_below_threshold_stays_closed() -> None:
    b = CircuitBreaker(CFG)
    for i in range(100):  # 4 % slow outliers: p95 stays fast
        b.record(i * 0.1, 3000 if i % 25 == 24 else 100, True)
    assert b.current(10.0) is CircuitState.CLOSED


def test_error_rate_trips_and_old_samples_expire() -> None:
    b = CircuitBreaker(CFG)
    b.record(0.0, 10, False)  # one error at t=0
    for i in range(30):
        b.record(31.0 + i * 0.01, 10, True)  # t=0 sample left the 30 s window
    assert b.current(32.0) is CircuitState.CLOSED
    b.record(32.5, 10, False)  # 1 / 31 > 1 %
    assert b.current(32.5) is CircuitState.OPEN


def test_half_open_probe_cycle_with_backoff() -> None:
    b = CircuitBreaker(CFG)
    b.force_open(100.0, "connection refused")
    assert b.view_state(104.9) is CircuitState.OPEN
    assert b.retry_in(104.0) == pytest.approx(1.0)
    assert b.view_state(105.0) is CircuitState.HALF_OPEN
    b.on_dispatch(105.0)
    assert b.view_state(105.1) is CircuitState.OPEN  # the single probe slot is taken
    b.record(105.2, 2000, True)  # slow probe -> open again, cool-down doubles to 10 s
    assert b.current(105.2) is CircuitState.OPEN
    assert b.current(114.0) is CircuitState.OPEN
    assert b.current(115.2) is CircuitState.HALF_OPEN
    b.on_dispatch(115.3)
    b.record(115.4, 50, True)
    assert b.current(115.4) is CircuitState.HALF_OPEN  # needs 2 good probes
    b.on_dispatch(115.5)
    assert b.record(115.6, 50, True) is CircuitState.CLOSED
    b.force_open(200.0)
    assert b.retry_in(200.0) == pytest.approx(5.0)  # closing reset the back-off


def test_counting_rule_equals_sorted_p95() -> None:
    # the O(1) slow-count rule trips exactly when p95 of the window exceeds the threshold
    import random

    rng = random.Random(4)
    for _ in range(200):
        n = rng.randrange(20, 120)
        lats = [rng.choice([100.0, 1500.0]) if rng.random() < 0.5 else rng.uniform(0, 2000) for _ in range(n)]
        b = CircuitBreaker(BreakerConfig(min_samples=n, window_s=1e9))
        for i, v in enumerate(lats):
            b.record(float(i), v, True)
        assert (b.current(float(n)) is CircuitState.OPEN) == (p95(lats) > 1200.0)
