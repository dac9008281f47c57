"""The canary's bounds at their edges: a latency regression of exactly 15 % fails (the bound is "< 15 %"), one
just under passes, for the probe median and the live decode p50 alike; the memory (5 %), consistency (0.99) and
error-rate (+1 point) bounds just either side."""

from __future__ import annotations

import math

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.rollout.canary import CanaryThresholds, VersionSample, analyse, probe_prompts, relative_change

pytestmark = pytest.mark.unit
TH = CanaryThresholds()
OUT = {0: [5, 6, 7, 8]}


def sample(**kw: object) -> VersionSample:
    base: dict[str, object] = dict(outputs=OUT, latencies_s=[20.0], probes=100, kv_tokens=20000.0, workers=1)
    base.update(kw)
    return VersionSample(**base)  # type: ignore[arg-type]


def test_the_default_bounds() -> None:
    assert (TH.min_consistency, TH.max_latency_regression, TH.max_memory_diff) == (0.99, 0.15, 0.05)
    assert TH.max_error_rate_increase == 0.01


# 20 → 23 is +15 % exactly in binary floating point (3 / 20 == 0.15); 22.99 is just under
@pytest.mark.parametrize(("new_s", "fails"), [(23.0, True), (22.99, False), (23.01, True)])
def test_probe_latency_regression_of_exactly_15_percent_fails(new_s: float, fails: bool) -> None:
    assert relative_change(20.0, 23.0) == 0.15
    v = analyse(sample(), sample(latencies_s=[new_s]), TH)
    assert ("latency" in v.failed) is fails
    assert v.latency_regression == pytest.approx((new_s - 20.0) / 20.0)
    if fails:
        assert "latency: probe median latency" in v.reasons[0] and ">= 15 %" in v.reasons[0]


@pytest.mark.parametrize(("new_ms", "fails"), [(23.0, True), (22.99, False)])
def test_live_decode_regression_of_exactly_15_percent_fails(new_ms: float, fails: bool) -> None:
    v = analyse(sample(live_decode_p50_ms=20.0), sample(live_decode_p50_ms=new_ms), TH)
    assert ("latency" in v.failed) is fails
    if fails:
        assert v.reasons == ("latency: live decode p50 +15.0 % >= 15 %",)


def test_the_probe_latency_is_the_median() -> None:
    # medians 20 and 23 (+15 %), though the means differ by far less
    assert analyse(sample(latencies_s=[1.0, 20.0, 21.0]), sample(latencies_s=[1.0, 23.0, 23.0]), TH).failed == (
        "latency",
    )


@pytest.mark.parametrize(("kv", "fails"), [(21000.0, True), (20999.0, False), (19000.0, True), (19001.0, False)])
def test_memory_difference_of_exactly_5_percent_fails(kv: float, fails: bool) -> None:
    assert ("memory" in analyse(sample(), sample(kv_tokens=kv), TH).failed) is fails


def test_consistency_exactly_at_the_bound_passes() -> None:
    th = CanaryThresholds(min_consistency=0.5)
    # one probe the same, one sharing nothing: mean cosine 0.5 exactly
    old, new = {0: [1], 1: [2]}, {0: [1], 1: [3]}
    assert analyse(sample(outputs=old), sample(outputs=new), th).passed
    assert analyse(sample(outputs=old), sample(outputs=new), CanaryThresholds(min_consistency=0.5001)).failed == (
        "consistency",
    )


@pytest.mark.parametrize(("errors", "fails"), [(1, False), (2, True)])
def test_a_probe_error_rate_one_point_worse_passes_more_fails(errors: int, fails: bool) -> None:
    # old 0 / 100, new errors / 100: +0.01 is not more than the bound
    assert ("errors" in analyse(sample(), sample(probe_errors=errors), TH).failed) is fails


@pytest.mark.parametrize(("live", "fails"), [(0.01, False), (0.0101, True)])
def test_a_live_error_rate_one_point_worse_passes_more_fails(live: float, fails: bool) -> None:
    v = analyse(sample(live_error_rate=0.0), sample(live_error_rate=live), TH)
    assert ("errors" in v.failed) is fails


def test_every_failure_reason_is_spelled_out() -> None:
    v = analyse(
        sample(latencies_s=[20.0], kv_tokens=20000.0, probes=100, live_decode_p50_ms=20.0),
        sample(latencies_s=[30.0], kv_tokens=10000.0, probes=100, probe_errors=50, live_decode_p50_ms=40.0),
        TH,
    )
    assert v.failed == ("latency", "memory", "errors")
    assert v.reasons == (
        "latency: probe median latency +50.0 % >= 15 %",
        "latency: live decode p50 +100.0 % >= 15 %",
        "memory: KV pool differs by 50.0 % >= 5 %",
        "errors: probe error rate 0.500 vs 0.000 for the old version",
    )
    assert (v.latency_regression, v.memory_diff) == (0.5, 0.5) and not v.passed


def test_the_old_version_s_probe_error_rate_is_a_rate() -> None:
    # old 1 / 100 failed, new 2 / 100: +0.01, not more than the bound (a count would read 100 vs 0.02)
    assert analyse(sample(probe_errors=1), sample(probe_errors=2), TH).passed
    v = analyse(sample(probe_errors=1), sample(probe_errors=3), TH)  # +0.02: fails
    assert v.reasons == ("errors: probe error rate 0.030 vs 0.010 for the old version",)
    assert analyse(sample(probes=0), sample(probes=0), TH).passed  # no probe sent: no error rate to compare


def test_coverage_and_consistency_reasons() -> None:
    v = analyse(sample(workers=0), sample(), TH)
    assert (v.passed, v.failed, v.reasons) == (
        False,
        ("coverage",),
        ("coverage: no up worker of the old version to measure",),
    )
    v = analyse(sample(outputs={0: [1]}), sample(outputs={1: [1]}), TH)
    assert v.failed == ("consistency",) and v.reasons == ("consistency: no probe answered by both versions",)
    assert v.consistency == 0.0 and v.latency_regression == 0.0 and v.memory_diff == 0.0


def test_live_decode_latency_counts_only_when_both_report() -> None:
    assert analyse(sample(live_decode_p50_ms=20.0), sample(live_decode_p50_ms=0.5), TH).passed  # faster
    v = analyse(sample(live_decode_p50_ms=0.5), sample(live_decode_p50_ms=0.6), TH)  # +20 %, sub-ms both
    assert v.failed == ("latency",)
    assert analyse(sample(latencies_s=[]), sample(latencies_s=[40.0]), TH).latency_regression == 0.0


def test_relative_change_edges() -> None:
    assert relative_change(0.0, 0.0) == 0.0 and relative_change(0.0, 1.0) == math.inf
    assert relative_change(4.0, 2.0) == -0.5


def test_threshold_validation_edges() -> None:
    assert CanaryThresholds(min_consistency=1.0).validated().min_consistency == 1.0  # 1 is allowed
    assert CanaryThresholds(max_memory_diff=0.0).validated().max_memory_diff == 0.0
    with pytest.raises(InvalidArgument) as e:
        CanaryThresholds(min_consistency=1.0001).validated()
    assert e.value.field == "min_consistency" and "must be <= 1, got 1.0001" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        CanaryThresholds(max_error_rate_increase=-0.001).validated()
    assert e.value.field == "max_error_rate_increase" and "must be a finite number >= 0" in str(e.value)


def test_the_probe_set_is_fixed_to_the_value() -> None:
    assert probe_prompts(2, 4) == [[586, 439, 830, 55], [77, 384, 258, 997]]
    assert probe_prompts(1, 3, vocab=10, seed=7) == [[7, 5, 4]]
    assert len(probe_prompts(1, 1)) == 1 and len(probe_prompts(1, 1)[0]) == 1  # 1 and 1 are allowed
    for count, length in ((0, 1), (1, 0)):
        with pytest.raises(InvalidArgument) as e:
            probe_prompts(count, length)
        assert e.value.field == "probe_prompts"


def test_reasons_show_the_configured_bounds() -> None:
    th = CanaryThresholds(max_latency_regression=0.9, max_memory_diff=0.9)
    v = analyse(
        sample(live_decode_p50_ms=10.0),
        sample(latencies_s=[40.0], kv_tokens=1000.0, live_decode_p50_ms=20.0, live_error_rate=0.5),
        th,
    )
    assert v.reasons == (
        "latency: probe median latency +100.0 % >= 90 %",
        "latency: live decode p50 +100.0 % >= 90 %",
        "memory: KV pool differs by 95.0 % >= 90 %",
        "errors: live error rate 0.500 vs 0.000",
    )


def test_an_old_version_that_sent_no_probe_has_no_errors() -> None:
    # the old version's rate is 0 when it sent none, so the new one's 5 % is 5 points worse
    assert analyse(sample(probes=0), sample(probes=100, probe_errors=5), TH).failed == ("errors",)


def test_the_probe_set_s_bounds_are_named() -> None:
    with pytest.raises(InvalidArgument, match=r"need count >= 1 and length >= 1, got 0, 4"):
        probe_prompts(0, 4)
