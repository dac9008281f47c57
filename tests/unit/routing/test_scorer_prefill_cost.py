"""prefill-cost: P(w) = max(prompt - overlap, 0) + queued + inflight, divided by the max over candidates."""

import pytest

from kvmesh.routing.scorers import PrefillCostScorer, prefill_tokens
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_raw_tokens_and_normalisation() -> None:
    req = RoutingQuery("r", prompt_tokens=100, block_size=16, matches={"a": 4, "b": 10})
    a = WorkerView("a", prefill_tokens_queued=10)
    b = WorkerView("b", inflight_prefill_tokens=5)  # 10 blocks = 160 tokens > prompt -> 0 new
    c = WorkerView("c")
    assert [prefill_tokens(req, w) for w in (a, b, c)] == [36 + 10, 0 + 5, 100]
    assert PrefillCostScorer().score(req, [a, b, c], [a, b, c]) == pytest.approx([0.46, 0.05, 1.0])


def test_all_zero_is_all_zero() -> None:
    req = RoutingQuery("r", prompt_tokens=0)
    assert PrefillCostScorer().score(req, [WorkerView("a")], []) == [0.0]
