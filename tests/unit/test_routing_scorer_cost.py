"""cost: (alpha·P + (1-alpha)·D) / S on one shared scale S = max(max P, max D)."""

import pytest

from kvmesh.routing.scorers import CostScorer
from kvmesh.routing.types import RouteRequest, WorkerView

pytestmark = pytest.mark.unit


def test_formula_on_shared_scale() -> None:
    req = RouteRequest("r", prompt_tokens=1000, block_size=100, matches={"hot": 9})
    hot = WorkerView("hot", decode_tokens_active=2000)  # P = 100, D = 2000
    cold = WorkerView("cold", decode_tokens_active=0)  # P = 1000, D = 0
    s = CostScorer(prefill_weight=0.5, decode_weight=0.5)
    # S = 2000
    assert s.score(req, [hot, cold], [hot, cold]) == pytest.approx([(50 + 1000) / 2000, 500 / 2000])
    s.set_weights(0.9, 0.1)
    assert s.alpha == pytest.approx(0.9)
    assert s.score(req, [hot, cold], [hot, cold]) == pytest.approx([(90 + 200) / 2000, 900 / 2000])


def test_bad_weights_rejected_and_unchanged() -> None:
    s = CostScorer(0.7, 0.3)
    with pytest.raises(ValueError):
        s.set_weights(0, 0)
    with pytest.raises(ValueError):
        s.set_weights(-1, 1)
    assert s.alpha == pytest.approx(0.7)


def test_cached_worker_loses_after_bounded_extra_load() -> None:
    # With alpha = 0.9 the cached worker keeps winning only while 0.1·D < 0.9·(prompt it saves):
    # fewer than ~9 prompts' worth of decode KV, then the cold worker is cheaper.
    s = CostScorer(0.9, 0.1)
    req = RouteRequest("r", prompt_tokens=1024, block_size=16, matches={"hot": 64})
    wins = 0
    hot, cold = WorkerView("hot"), WorkerView("cold")
    for _ in range(50):
        c = s.score(req, [hot, cold], [hot, cold])
        if c[0] >= c[1]:
            break
        wins += 1
        hot.inflight_decode_tokens += 1024
    assert 8 <= wins <= 10
