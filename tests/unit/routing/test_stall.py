"""`kvmesh.routing.stall`: a worker's stall bounds follow its own recent latencies, clamped; a worker without
samples gets the ceiling; the load-report age bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.routing.stall import StallConfig, WorkerLatency, clamp, ewma, report_age_bound, stall_check

pytestmark = pytest.mark.unit

CFG = StallConfig(itl_factor=10, itl_floor_s=1.0, itl_ceiling_s=5.0, ttft_factor=5, ttft_floor_s=1.5, ttft_ceiling_s=30)


def test_without_samples_the_bounds_are_the_ceilings() -> None:
    lat = WorkerLatency()
    assert lat.itl_bound(CFG) == 5.0 and lat.ttft_bound(CFG, 100) == 30.0


def test_the_itl_bound_is_k_times_the_mean_gap_within_floor_and_ceiling() -> None:
    lat = WorkerLatency()
    lat.on_gap(0.2, alpha=0.5)
    assert lat.itl_bound(CFG) == pytest.approx(2.0)
    lat.on_gap(0.4, alpha=0.5)  # mean 0.3
    assert lat.itl_bound(CFG) == pytest.approx(3.0)
    fast = WorkerLatency()
    fast.on_gap(0.02, alpha=0.5)
    assert fast.itl_bound(CFG) == 1.0  # 0.2 s clamped up: a GC pause is no stall
    slow = WorkerLatency()
    slow.on_gap(2.0, alpha=0.5)
    assert slow.itl_bound(CFG) == 5.0


def test_the_ttft_bound_scales_with_the_tokens_to_compute() -> None:
    lat = WorkerLatency()
    lat.on_first_token(0.5, prompt_tokens=1000, alpha=0.2)  # 0.5 ms per token
    assert lat.ttft_bound(CFG, 1000) == pytest.approx(2.5)
    assert lat.ttft_bound(CFG, 8000) == pytest.approx(20.0)
    assert lat.ttft_bound(CFG, 10) == 1.5
    assert lat.ttft_bound(CFG, 10**6) == 30.0


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=50), st.integers(0, 10**6))
def test_bounds_always_lie_within_floor_and_ceiling(gaps: list[float], n: int) -> None:
    lat = WorkerLatency()
    for g in gaps:
        lat.on_gap(g, CFG.ewma_alpha)
        lat.on_first_token(g, n, CFG.ewma_alpha)
    assert CFG.itl_floor_s <= lat.itl_bound(CFG) <= CFG.itl_ceiling_s
    assert CFG.ttft_floor_s <= lat.ttft_bound(CFG, n) <= CFG.ttft_ceiling_s


def test_ewma_and_clamp() -> None:
    assert ewma(None, 3.0, 0.2) == 3.0 and ewma(1.0, 3.0, 0.5) == 2.0
    assert clamp(0.1, 1, 5) == 1 and clamp(9, 1, 5) == 5 and clamp(2, 1, 5) == 2


def test_report_age_bound() -> None:
    assert report_age_bound(0.2, 5, 2.0, 10.0) == 2.0  # 1 s, the floor wins
    assert report_age_bound(1.0, 5, 2.0, 10.0) == 5.0
    assert report_age_bound(5.0, 5, 2.0, 10.0) == 10.0


def test_a_stream_past_its_bound_is_stalled_only_while_its_worker_is_silent_too() -> None:
    # waiting since 10 s for the next token, bound 1 s, ceiling 5 s
    assert stall_check(11.0, 10.0, last_seen=9.0, bound=1.0, ceiling=5.0) is None  # silent worker: stalled
    assert stall_check(11.0, 10.0, last_seen=10.8, bound=1.0, ceiling=5.0) == pytest.approx(11.8)  # it reports
    assert stall_check(10.5, 10.0, last_seen=9.0, bound=1.0, ceiling=5.0) == pytest.approx(11.0)  # not yet
    assert stall_check(15.0, 10.0, last_seen=14.9, bound=1.0, ceiling=5.0) is None  # the ceiling: stalled anyway
    assert stall_check(14.5, 10.0, last_seen=14.4, bound=1.0, ceiling=5.0) == pytest.approx(15.0)
