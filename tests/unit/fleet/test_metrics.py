"""Metrics, reference hit ratios and the capacity bisection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.metrics import RequestRecord, Slo, pct, summarize
from kvmesh.fleet.reference import ideal_hit_ratio, pooled_lru_hit_ratio

pytestmark = pytest.mark.unit


def test_nearest_rank_percentile() -> None:
    assert pct(list(range(1, 101)), 99) == 99
    assert pct([5.0], 50) == 5.0
    assert pct(list(range(1, 11)), 90) == 9
    assert math.isnan(pct([], 50))


def test_summarize_slo_goodput_and_utilisation() -> None:
    recs = [RequestRecord(i, "w0", 0.0, 1000, 11, first_token=0.5, finish=1.5, cached_tokens=500) for i in range(99)]
    recs.append(RequestRecord(99, "w1", 0.0, 1000, 11, first_token=3.0, finish=5.0))  # TTFT 3 s, ITL 200 ms
    s = summarize(recs, {"w0": 4.0, "w1": 1.0}, Slo(2.0, 0.1, "absolute"), work_s={"w0": 4.0, "w1": 1.0})
    assert s["goodput"] == pytest.approx(0.99)
    assert s["meets_slo"] is True  # one violation in 100 is inside p99
    assert s["hit_ratio"] == pytest.approx(99 * 500 / 100_000)
    assert s["util_variance"] == pytest.approx(np.var([4 / 5, 1 / 5]))
    recs.append(RequestRecord(100, "w1", 0.0, 1000, 11, first_token=4.0, finish=6.0))
    assert summarize(recs, {"w0": 1.0}, Slo(2.0, 0.1, "absolute"))["meets_slo"] is False
    # excess mode: the prompt's own cold prefill time is allowed on top of the SLO
    for r in recs:
        r.ttft_allow = 2.5
    assert summarize(recs, {"w0": 1.0}, Slo(2.0, 1.0, "excess"))["meets_slo"] is True


def test_pooled_lru_hand_example() -> None:
    h = np.array
    prompts = [(40, h([1, 2])), (40, h([1, 2])), (40, h([3, 4])), (40, h([1, 2]))]
    # block 16: hits 0, 32, 0, then [1,2] again: with room for 4 blocks → 32; with room for 2 → evicted → 0
    assert pooled_lru_hit_ratio(prompts, 16, 4) == pytest.approx(64 / 160)
    assert pooled_lru_hit_ratio(prompts, 16, 2) == pytest.approx(32 / 160)
    assert ideal_hit_ratio(prompts, 16) == pytest.approx(64 / 160)


def test_bisection_brackets_and_converges() -> None:
    c = bisect_capacity(lambda s: s <= 2.7, start=0.5)
    assert c.value <= 2.7 < c.upper and c.upper / c.value <= 1.05
    assert all(ok == (s <= 2.7) for s, ok in c.probes)
    z = bisect_capacity(lambda s: False)
    assert z.value == 0.0 and len(z.probes) <= 16
    big = bisect_capacity(lambda s: True, max_scale=8.0)
    assert big.value == 8.0 and big.upper == math.inf
