"""The circuit breaker at the edges of its documented thresholds: p95 > 1200 ms and error rate > 1 % (just
either side of each), the slow-count rule at its boundary, the window's oldest instant, the sample cap, and
what opening and closing reset. Each test fails if a threshold moves by one unit or a comparison flips."""

from __future__ import annotations

import math

import pytest

from kvmesh.routing.circuit import BreakerConfig, CircuitBreaker, p95
from kvmesh.routing.types import CircuitState

pytestmark = pytest.mark.unit
FAST = 100.0
LIMIT = 1200.0
CFG = BreakerConfig(min_samples=20, window_s=30.0, cooldown_s=5.0, max_cooldown_s=20.0, probe_successes=2)


def feed(b: CircuitBreaker, latencies: list[float], start: float = 0.0, ok: bool = True) -> CircuitState:
    state = b.current(start)
    for i, lat in enumerate(latencies):
        state = b.record(start + i * 0.01, lat, ok)
    return state


def slow_needed(n_ok: int) -> int:
    """How many of n_ok latencies must exceed the threshold for the p95 (rank ceil(0.95·n)) to exceed it."""
    return n_ok - math.ceil(0.95 * n_ok) + 1


def test_p95_is_the_value_at_rank_ceil_95_percent() -> None:
    assert p95([7.0]) == 7.0  # rank 1 of 1: index 0, not 1
    assert p95([1.0, 2.0]) == 2.0
    assert p95([float(v) for v in range(1, 21)]) == 19.0  # rank ceil(19.0) = 19
    assert p95([float(v) for v in range(1, 22)]) == 20.0  # rank ceil(19.95) = 20


@pytest.mark.parametrize(("latency", "trips"), [(LIMIT, False), (LIMIT + 0.001, True)])
def test_p95_exactly_at_the_threshold_stays_closed_just_above_trips(latency: float, trips: bool) -> None:
    b = CircuitBreaker(CFG)
    state = feed(b, [latency] * CFG.min_samples)
    assert (state is CircuitState.OPEN) is trips
    assert (b.trips == 1) is trips


@pytest.mark.parametrize("n", [20, 21, 40, 100])
def test_slow_count_one_below_the_p95_rank_stays_closed_at_it_trips(n: int) -> None:
    need = slow_needed(n)
    below = CircuitBreaker(BreakerConfig(min_samples=n, window_s=1e9))
    lats = [FAST] * (n - need + 1) + [LIMIT + 1] * (need - 1)
    assert p95(lats) <= LIMIT
    assert feed(below, lats) is CircuitState.CLOSED
    at = CircuitBreaker(BreakerConfig(min_samples=n, window_s=1e9))
    lats = [FAST] * (n - need) + [LIMIT + 1] * need
    assert p95(lats) > LIMIT
    assert feed(at, lats) is CircuitState.OPEN and f"({need}/{n} slow)" in at.reason


def test_failures_do_not_count_toward_the_p95_sample_count() -> None:
    # 99 fast, one failure (1 % exactly: no trip), then slow successes: the p95 is over the 99 + k successes
    b = CircuitBreaker(BreakerConfig(min_samples=20, window_s=1e9))
    assert feed(b, [FAST] * 99) is CircuitState.CLOSED
    assert b.record(1.0, FAST, False) is CircuitState.CLOSED
    k = 0
    while b.current(2.0) is CircuitState.CLOSED:
        k += 1
        b.record(2.0, LIMIT + 1, True)
        assert k <= 10
    assert k == slow_needed(99 + k)  # the rule counts successes only, not every sample
    assert b.reason.startswith("p95") and f"({k}/{99 + k} slow)" in b.reason


def test_needs_min_samples_counting_exactly() -> None:
    b = CircuitBreaker(CFG)
    assert feed(b, [LIMIT + 1] * (CFG.min_samples - 1)) is CircuitState.CLOSED
    assert b.record(1.0, LIMIT + 1, True) is CircuitState.OPEN


def test_error_rate_exactly_one_percent_stays_closed() -> None:
    b = CircuitBreaker(CFG)
    assert feed(b, [FAST] * 99) is CircuitState.CLOSED
    assert b.record(1.0, FAST, False) is CircuitState.CLOSED  # 1 / 100 = 0.01, not > 0.01


def test_error_rate_just_above_one_percent_trips_without_backoff() -> None:
    b = CircuitBreaker(CFG)
    assert feed(b, [FAST] * 98) is CircuitState.CLOSED
    assert b.record(1.0, FAST, False) is CircuitState.OPEN  # 1 / 99 > 0.01
    assert b.reason == "error rate 0.010 > 0.01"
    assert b.retry_in(1.0) == pytest.approx(CFG.cooldown_s)  # a trip from CLOSED does not double the cool-down


def test_a_p95_trip_does_not_back_off_either() -> None:
    b = CircuitBreaker(CFG)
    assert feed(b, [LIMIT + 1] * CFG.min_samples, start=10.0) is CircuitState.OPEN
    assert b.retry_in(10.5) == pytest.approx(CFG.cooldown_s - 0.5 + 0.19)


# min_samples 100: a failure can be the oldest sample without tripping the breaker on its own
WIDE = BreakerConfig(min_samples=100, window_s=30.0)


def test_a_sample_exactly_window_s_old_still_counts() -> None:
    b = CircuitBreaker(WIDE)
    b.record(0.0, FAST, False)
    feed(b, [FAST] * 98, start=1.0)
    # at t = 30.0 the t = 0 failure is exactly window_s old: still in, so 1 / 100 stays closed...
    assert b.record(30.0, FAST, True) is CircuitState.CLOSED
    # ...and one more failure at that instant makes 2 / 101 > 1 %
    assert b.record(30.0, FAST, False) is CircuitState.OPEN


def test_a_sample_just_older_than_the_window_is_dropped() -> None:
    b = CircuitBreaker(WIDE)
    b.record(0.0, FAST, False)
    feed(b, [FAST] * 99, start=1.0)
    assert b.current(2.0) is CircuitState.CLOSED  # 1 / 100
    assert b.record(30.001, FAST, False) is CircuitState.CLOSED  # the t = 0 failure left: 1 / 100, not 2 / 101


def test_the_sample_cap_keeps_exactly_max_samples() -> None:
    cfg = BreakerConfig(min_samples=100, max_samples=100, window_s=1e9)
    b = CircuitBreaker(cfg)
    b.record(0.0, FAST, False)
    feed(b, [FAST] * 99, start=1.0)  # 1 / 100: closed, and the failure is still one of the 100 kept
    assert b.current(2.0) is CircuitState.CLOSED
    # a 101st sample pushes the failure out: a second failure is then 1 / 100, not 2 / 101
    assert b.record(3.0, FAST, False) is CircuitState.CLOSED
    c = CircuitBreaker(cfg)
    c.record(0.0, FAST, False)
    feed(c, [FAST] * 98, start=1.0)
    assert c.record(3.0, FAST, False) is CircuitState.OPEN  # 2 / 100 with both failures kept


def test_slow_samples_leaving_the_window_stop_counting() -> None:
    cfg = BreakerConfig(min_samples=20, window_s=10.0)
    b = CircuitBreaker(cfg)
    b.record(0.0, LIMIT + 1, True)  # slow, then it ages out
    feed(b, [FAST] * 19, start=20.0)
    # of 20 kept, one slow: p95 fast; of 21, two slow: p95 slow (rank 20 of 21)
    assert b.record(21.0, LIMIT + 1, True) is CircuitState.CLOSED
    assert b.record(21.1, LIMIT + 1, True) is CircuitState.OPEN


def test_samples_exactly_at_the_limit_are_not_slow_when_they_leave_either() -> None:
    c = CircuitBreaker(BreakerConfig(min_samples=20, window_s=10.0))
    feed(c, [LIMIT] * 5, start=0.0)
    feed(c, [FAST] * 19, start=20.0)  # the five at-limit samples left the window
    assert c.record(21.0, LIMIT + 1, True) is CircuitState.CLOSED
    assert c.record(21.1, LIMIT + 1, True) is CircuitState.OPEN


def test_half_open_probe_exactly_at_the_threshold_is_good() -> None:
    b = CircuitBreaker(CFG)
    b.force_open(0.0)
    b.on_dispatch(5.0)
    assert b.record(5.1, LIMIT, True) is CircuitState.HALF_OPEN  # ≤ threshold: a good probe
    b.on_dispatch(5.2)
    assert b.record(5.3, LIMIT + 0.001, True) is CircuitState.OPEN
    assert b.reason == "probe failed"
    assert b.retry_in(5.3) == pytest.approx(2 * CFG.cooldown_s)


def test_probe_slots_free_one_at_a_time() -> None:
    b = CircuitBreaker(BreakerConfig(half_open_probes=2, probe_successes=3))
    b.force_open(0.0)
    b.on_dispatch(5.0)  # the cool-down ended: this dispatch is the first probe
    assert b.view_state(5.0) is CircuitState.HALF_OPEN  # one of two slots taken
    b.on_dispatch(5.0)
    assert b.view_state(5.0) is CircuitState.OPEN
    b.record(5.1, FAST, True)
    assert b.view_state(5.1) is CircuitState.HALF_OPEN  # exactly one slot returned
    b.on_dispatch(5.2)
    assert b.view_state(5.2) is CircuitState.OPEN


def test_an_outcome_after_the_cool_down_is_a_probe_result() -> None:
    b = CircuitBreaker(CFG)
    b.force_open(0.0)
    assert b.record(5.0, FAST, True) is CircuitState.HALF_OPEN  # no call in between moved it to HALF_OPEN
    assert b.record(5.1, FAST, True) is CircuitState.CLOSED


def test_one_slow_success_among_failures_trips_on_p95_when_errors_are_tolerated() -> None:
    b = CircuitBreaker(BreakerConfig(min_samples=2, error_rate_threshold=1.0))
    assert b.record(0.0, FAST, False) is CircuitState.CLOSED
    assert b.record(0.1, LIMIT + 1, True) is CircuitState.OPEN  # p95 of the one success is slow
    assert b.reason.startswith("p95") and "(1/1 slow)" in b.reason


def test_force_open_in_half_open_backs_off_and_records_its_reason() -> None:
    b = CircuitBreaker(CFG)
    b.force_open(0.0)
    assert b.reason == "forced" and b.trips == 1
    b.force_open(1.0, "stream reset")  # still OPEN: no back-off
    assert b.retry_in(1.0) == pytest.approx(CFG.cooldown_s) and b.reason == "stream reset"
    b.force_open(6.0, "connection refused")  # the cool-down (from 1.0) ended: HALF_OPEN, so it backs off
    assert b.reason == "connection refused" and b.trips == 3
    assert b.retry_in(6.0) == pytest.approx(2 * CFG.cooldown_s)


def test_retry_in_is_zero_unless_open() -> None:
    b = CircuitBreaker(CFG)
    assert b.retry_in(0.0) == 0.0
    b.force_open(0.0)
    assert b.retry_in(5.0) == 0.0  # HALF_OPEN now
    assert b.retry_in(4.5) == 0.0  # time does not run back: stays HALF_OPEN
    c = CircuitBreaker(CFG)
    c.force_open(10.0)
    assert c.retry_in(14.999) == pytest.approx(0.001)


def test_a_new_breaker_starts_clean() -> None:
    b = CircuitBreaker(CFG)
    assert b.state is CircuitState.CLOSED and b.reason == "" and b.trips == 0
    assert b.view_state(0.0) is CircuitState.CLOSED
    b.force_open(0.0)
    assert b.current(CFG.cooldown_s) is CircuitState.HALF_OPEN  # opened at 0: exactly the cool-down later


def test_closing_resets_the_window() -> None:
    b = CircuitBreaker(CFG)
    feed(b, [LIMIT + 1] * CFG.min_samples)
    assert b.current(1.0) is CircuitState.OPEN
    for t in (6.0, 6.2):  # two good probes close it
        b.on_dispatch(t)
        b.record(t + 0.1, FAST, True)
    assert b.current(7.0) is CircuitState.CLOSED and b.reason == ""
    # the window starts empty: 19 fast and one slow of 20 keep p95 fast (no slow sample carried over)
    feed(b, [FAST] * (CFG.min_samples - 1), start=8.0)
    assert b.record(9.0, LIMIT + 1, True) is CircuitState.CLOSED
    c = CircuitBreaker(CFG)
    feed(c, [FAST] * 50)
    assert c.record(1.0, FAST, False) is CircuitState.OPEN  # 1 / 51
    for t in (6.0, 6.2):
        c.on_dispatch(t)
        c.record(t + 0.1, FAST, True)
    # no error carried over: one failure among 100 is 1 %, closed
    feed(c, [FAST] * 99, start=8.0)
    assert c.record(9.0, FAST, False) is CircuitState.CLOSED
