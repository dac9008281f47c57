"""Canary analysis (kvmesh.ops.rollout.canary): each check passing and failing, the histogram cosine, the probe set."""

from __future__ import annotations

import math

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.rollout.canary import (
    CanaryThresholds,
    VersionSample,
    analyse,
    consistency,
    histogram_cosine,
    probe_prompts,
)

TH = CanaryThresholds()
OUT = {0: [5, 6, 7, 8], 1: [9, 9, 10, 11], 2: [12, 13, 14, 15]}


def sample(**kw: object) -> VersionSample:
    base: dict[str, object] = dict(
        outputs=OUT, latencies_s=[1.0, 1.0, 1.0], probes=3, kv_tokens=32768.0, live_decode_p50_ms=10.0, workers=1
    )
    base.update(kw)
    return VersionSample(**base)  # type: ignore[arg-type]


def test_histogram_cosine_formula() -> None:
    assert histogram_cosine([1, 2, 3], [3, 2, 1]) == pytest.approx(1.0)  # same tokens, other order
    assert histogram_cosine([1, 2], [3, 4]) == 0.0
    # a = (1 of token 1, 1 of token 2), b = (2 of token 1): cos = 2 / (sqrt 2 * 2)
    assert histogram_cosine([1, 2], [1, 1]) == pytest.approx(1 / math.sqrt(2))
    assert histogram_cosine([], []) == 1.0 and histogram_cosine([1], []) == 0.0


def test_consistency_is_the_mean_over_common_probes() -> None:
    assert consistency({0: [1], 1: [2]}, {0: [1], 1: [3], 7: [4]}) == pytest.approx(0.5)
    assert consistency({0: [1]}, {1: [1]}) is None


def test_identical_versions_pass_every_check() -> None:
    v = analyse(sample(), sample(), TH)
    assert v.passed and v.failed == () and v.consistency == pytest.approx(1.0)


def test_different_outputs_fail_consistency() -> None:
    other = {0: [5, 6, 7, 8], 1: [1, 2, 3, 4], 2: [12, 13, 14, 15]}  # one probe in three answers differently
    v = analyse(sample(), sample(outputs=other), TH)
    assert not v.passed and v.failed == ("consistency",)
    assert v.consistency == pytest.approx(2 / 3) and "0.6667 < 0.99" in v.reasons[0]


@pytest.mark.parametrize(("new_s", "fails"), [(1.14, False), (1.16, True), (2.0, True), (0.5, False)])
def test_latency_regression_bound_is_15_percent(new_s: float, fails: bool) -> None:
    v = analyse(sample(), sample(latencies_s=[new_s] * 3), TH)
    assert ("latency" in v.failed) is fails
    assert v.latency_regression == pytest.approx(new_s - 1.0)


def test_live_decode_latency_regression_fails_and_unreported_is_skipped() -> None:
    assert analyse(sample(), sample(live_decode_p50_ms=12.0), TH).failed == ("latency",)
    assert analyse(sample(live_decode_p50_ms=0.0), sample(live_decode_p50_ms=50.0), TH).passed


@pytest.mark.parametrize(("kv", "fails"), [(32768 * 0.96, False), (32768 * 0.95, True), (32768 * 1.05, True)])
def test_memory_difference_bound_is_5_percent(kv: float, fails: bool) -> None:
    assert ("memory" in analyse(sample(), sample(kv_tokens=kv), TH).failed) is fails


def test_error_rates_probe_and_live() -> None:
    assert analyse(sample(), sample(probe_errors=1), TH).failed == ("errors",)
    assert analyse(sample(probe_errors=1), sample(probe_errors=1), TH).passed  # no worse than the old one
    assert analyse(sample(), sample(live_error_rate=0.02), TH).failed == ("errors",)
    assert analyse(sample(live_error_rate=0.02), sample(live_error_rate=0.025), TH).passed


def test_a_version_without_workers_fails_coverage() -> None:
    v = analyse(sample(), sample(workers=0, outputs={}, latencies_s=[]), TH)
    assert v.failed == ("coverage",) and "new version" in v.reasons[0]


def test_several_failures_are_all_reported() -> None:
    v = analyse(sample(), sample(latencies_s=[3.0], kv_tokens=1000.0, probe_errors=2), TH)
    assert set(v.failed) == {"latency", "memory", "errors"} and len(v.reasons) == 3


def test_thresholds_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="min_consistency"):
        CanaryThresholds(min_consistency=1.5).validated()
    with pytest.raises(InvalidArgument, match="max_latency_regression"):
        CanaryThresholds(max_latency_regression=float("nan")).validated()


def test_probe_prompts_are_fixed_and_in_range() -> None:
    a, b = probe_prompts(4, 16), probe_prompts(4, 16)
    assert a == b and len(a) == 4 and all(len(p) == 16 and all(3 <= t < 1000 for t in p) for p in a)
    assert len({tuple(p) for p in a}) == 4 and probe_prompts(4, 16, seed=1) != a
    with pytest.raises(InvalidArgument):
        probe_prompts(0, 16)
