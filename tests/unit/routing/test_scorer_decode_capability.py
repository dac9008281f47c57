"""decode-capability: cost = 1 - (1 - queue/max_queue)·(1 - latency/base)·hit_rate."""

import pytest

from kvmesh.routing.scorers import DecodeCapabilityScorer
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
REQ = RoutingQuery("r", prompt_tokens=1)


def test_formula_and_clipping() -> None:
    s = DecodeCapabilityScorer(base_latency_ms=1000)
    w = WorkerView("a", waiting=2, max_queue=8, decode_latency_p50_ms=200, prefix_hit_rate=0.5)
    assert s.capability(w) == pytest.approx(0.75 * 0.8 * 0.5)
    slow = WorkerView("b", decode_latency_p50_ms=5000, prefix_hit_rate=1.0)  # latency factor clips to 0
    assert s.score(REQ, [w, slow], []) == pytest.approx([1 - 0.3, 1.0])


def test_p95_and_floor() -> None:
    w = WorkerView("a", decode_latency_p50_ms=0, decode_latency_p95_ms=600, prefix_hit_rate=0.0)
    assert DecodeCapabilityScorer(base_latency_ms=1200, latency="p95", hit_rate_floor=0.1).capability(
        w
    ) == pytest.approx(0.5 * 0.1)
    assert DecodeCapabilityScorer().capability(w) == 0.0
