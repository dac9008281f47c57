"""min-cost picker: argmin outside the epsilon band; inside it, power-of-two-choices on in-flight counts."""

import collections

import pytest

from kvmesh.routing.pickers import MinCostPicker
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_clear_winner_is_always_chosen() -> None:
    p = MinCostPicker(epsilon=0.02, seed=1)
    ws = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    for i in range(50):
        assert p.pick(RoutingQuery(f"r{i}", 1), ws, [0.5, 0.1, 0.3]) == 1


def test_band_members_share_and_lower_inflight_wins() -> None:
    p = MinCostPicker(epsilon=0.05, choices=2, seed=3)
    ws = [WorkerView("a", inflight_requests=10), WorkerView("b"), WorkerView("c"), WorkerView("far")]
    totals = [0.10, 0.12, 0.14, 0.9]
    counts = collections.Counter(p.pick(RoutingQuery(f"r{i}", 1), ws, totals) for i in range(600))
    assert counts[3] == 0  # outside the band
    assert counts[1] > 150 and counts[2] > 150  # spread between the idle ones
    # 'a' (best cost, but 10 in flight) wins only when the sample is {a, a}: never with d = 2 distinct
    assert counts[0] == 0


def test_hash_tie_break_is_reproducible_per_request() -> None:
    ws = [WorkerView(str(i)) for i in range(8)]
    totals = [0.0] * 8
    p1, p2 = MinCostPicker(tie_break="hash", seed=7), MinCostPicker(tie_break="hash", seed=7)
    picks = [p1.pick(RoutingQuery(f"r{i}", 1), ws, totals) for i in range(100)]
    assert picks == [p2.pick(RoutingQuery(f"r{i}", 1), ws, totals) for i in range(100)]
    assert len(set(picks)) == 8


def test_epsilon_zero_is_plain_argmin() -> None:
    p = MinCostPicker(epsilon=0.0, seed=0)
    ws = [WorkerView("a"), WorkerView("b")]
    assert {p.pick(RoutingQuery(f"r{i}", 1), ws, [0.2, 0.2000001]) for i in range(20)} == {0}


def test_invalid_params() -> None:
    with pytest.raises(ValueError):
        MinCostPicker(epsilon=-1)
    with pytest.raises(ValueError):
        MinCostPicker(tie_break="nope")
